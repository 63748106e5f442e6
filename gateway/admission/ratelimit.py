"""Per-key rate limits (requests/min and tokens/min) enforced atomically in Redis by one Lua
script (RATE_LIMIT, shared/wire/scripts.py), so every gateway replica shares them. GCRA: each limit keeps one number, the theoretical
arrival time (TAT); a request of cost c moves it by c × 60 s / limit and is allowed while the TAT
stays within one minute of now (a full minute's budget may be spent in a burst)."""

from __future__ import annotations

from redis.exceptions import RedisError

from kvfleet.gateway.admission.auth import Principal
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import APIError, TooManyRequests
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import scripts

UNITS = {"rpm": "requests", "tpm": "tokens"}


class RateLimiter:
    """Checks and charges one request against its key's limits."""

    def __init__(self, redis: RedisContext, settings: GatewaySettings):
        self._redis = redis
        self._settings = settings
        self._script = scripts.RATE_LIMIT.register(redis.redis)

    def limits(self, principal: Principal) -> tuple[int, int]:
        rpm = principal.rpm if principal.rpm is not None else self._settings.rate_limit_rpm
        tpm = principal.tpm if principal.tpm is not None else self._settings.rate_limit_tpm
        return max(rpm, 0), max(tpm, 0)

    async def check(self, principal: Principal, tokens: int) -> None:
        """Raise TooManyRequests (429 + Retry-After) when the key is over a limit."""
        rpm, tpm = self.limits(principal)
        if not rpm and not tpm:
            return
        call = scripts.rate_limit(self._redis.keys, principal.key_id, rpm, tpm, tokens)
        try:
            allowed, retry_ms, which = await self._script(keys=call.keys, args=call.args)
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
