"""Per-key rate limits (requests/min and tokens/min) enforced atomically in Redis by one Lua
script, so every gateway replica shares them. GCRA: each limit keeps one number, the theoretical
arrival time (TAT); a request of cost c moves it by c × 60 s / limit and is allowed while the TAT
stays within one minute of now (a full minute's budget may be spent in a burst)."""

from __future__ import annotations

from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.admission.auth import Principal
from gateway.errors import APIError, TooManyRequests
from shared.keys import Keys
from shared.settings import GatewaySettings

# KEYS: request TAT, token TAT. ARGV: rpm, tpm, tokens (a limit of 0 is off).
# Returns {allowed (1/0), retry after ms, which ('rpm'/'tpm'/'')}. Both limits are checked before
# either is charged; Redis's own clock is the clock of every replica.
_GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period = 60000
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {1, tonumber(ARGV[3])}
local names = {'rpm', 'tpm'}
local tats = {}
for i = 1, 2 do
  if limits[i] > 0 then
    if costs[i] > limits[i] then return {0, -1, names[i]} end
    local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
    if tat < now then tat = now end
    local new_tat = tat + costs[i] * period / limits[i]
    local wait = new_tat - now - period
    if wait > 0 then return {0, math.ceil(wait), names[i]} end
    tats[i] = new_tat
  end
end
for i = 1, 2 do
  if tats[i] then
    redis.call('SET', KEYS[i], string.format('%.3f', tats[i]), 'PX',
               math.ceil(tats[i] - now) + 1000)
  end
end
return {1, 0, ''}
"""

UNITS = {"rpm": "requests", "tpm": "tokens"}


class RateLimiter:
    """Checks and charges one request against its key's limits."""

    def __init__(self, redis_getter: Callable[[], Redis], keys: Keys, settings: GatewaySettings):
        self._redis_getter = redis_getter
        self._keys = keys
        self._settings = settings
        self._script = None

    def limits(self, principal: Principal) -> tuple[int, int]:
        rpm = principal.rpm if principal.rpm is not None else self._settings.rate_limit_rpm
        tpm = principal.tpm if principal.tpm is not None else self._settings.rate_limit_tpm
        return max(rpm, 0), max(tpm, 0)

    async def check(self, principal: Principal, tokens: int) -> None:
        """Raise TooManyRequests (429 + Retry-After) when the key is over a limit."""
        rpm, tpm = self.limits(principal)
        if not rpm and not tpm:
            return
        redis = self._redis_getter()
        if self._script is None:
            self._script = redis.register_script(_GCRA_LUA)
        keys = [self._keys.rate_limit(principal.key_id, "req"),
                self._keys.rate_limit(principal.key_id, "tok")]
        try:
            allowed, retry_ms, which = await self._script(keys=keys, args=[rpm, tpm, tokens])
        except (RedisError, OSError) as exc:
            raise APIError(503, f"Cannot check the rate limit: Redis does not answer ({exc!r}).",
                           error_type="service_unavailable") from exc
        if allowed:
            return
        which = which.decode() if isinstance(which, bytes) else which
        limit = rpm if which == "rpm" else tpm
        if int(retry_ms) < 0:
            raise TooManyRequests(
                f"Request too large: {tokens} tokens (prompt + max_tokens) is more than the "
                f"key's limit of {limit} tokens per minute.", 60, code="request_too_large")
        raise TooManyRequests(
            f"Rate limit reached for key {principal.key_id}: {limit} {UNITS[which]} per minute. "
            f"Retry in {int(retry_ms) / 1000:.1f} s.", int(retry_ms) / 1000,
            code="rate_limit_exceeded")
