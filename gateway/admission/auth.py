"""Optional API keys: plaintext keys from settings (`KVFLEET_API_KEYS`) and keys kept in Redis as
SHA-256 hashes (`kvfleet keys`). When any key exists, every `/v1/*` request needs
`Authorization: Bearer <key>`, and so do `/tokenize` and `/detokenize`; `/health`, `/ready`,
`/metrics`, `/version` and `/dashboard` stay open. The admin routes check their key themselves
(gateway/admin.py)."""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from kvfleet.gateway.admission.early_answer import UnreadBody
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import APIError
from kvfleet.shared.wire import ApiKeyRecord, Keys, api_key_field

PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # vLLM's utility routes: they do the model's work
KEY_PREFIX = "kvf-"  # plaintext keys start with it, so a leaked one is recognisable


@dataclass(frozen=True)
class Principal:
    """Who sent a request: an API key's id and its own limits (None = the settings' default)."""

    key_id: str
    name: str = ""
    rpm: int | None = None
    tpm: int | None = None


def principal_of(record: ApiKeyRecord) -> Principal:
    return Principal(record.id, record.name, record.rpm, record.tpm)


def new_key() -> tuple[str, str]:
    """(key id, plaintext key): the id is public (logs, `kvfleet keys list`), the key is secret."""
    return f"key_{secrets.token_hex(4)}", KEY_PREFIX + secrets.token_urlsafe(32)


def invalid_api_key(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


class ApiKeyStore:
    """Looks keys up: settings' keys in memory, Redis keys by hash (one HGET per request, so a
    revocation takes effect at once). Whether Redis holds any key is cached for `cache_s`."""

    def __init__(self, plaintext_keys: str, redis: RedisContext | None, cache_s: float = 1.0):
        self._env = {api_key_field(k.strip()): f"env-{api_key_field(k.strip())[:8]}"
                     for k in plaintext_keys.split(",") if k.strip()}
        self._redis = redis
        self._cache_s = cache_s
        self._redis_has_keys = False
        self._checked_at = -float("inf")

    async def required(self) -> bool:
        """True when any key is configured (then every /v1 request must carry one)."""
        if self._env:
            return True
        if self._redis is None:
            return False
        if time.monotonic() - self._checked_at >= self._cache_s:
            self._redis_has_keys = bool(await self._redis.redis.hlen(self._redis.keys.api_keys()))
            self._checked_at = time.monotonic()
        return self._redis_has_keys

    async def lookup(self, key: str) -> Principal | None:
        digest = api_key_field(key)
        for known, key_id in self._env.items():
            if hmac.compare_digest(known, digest):
                return Principal(key_id)
        if self._redis is None:
            return None
        raw = await self._redis.redis.hget(self._redis.keys.api_keys(), digest)
        return principal_of(ApiKeyRecord.decode(raw)) if raw else None

    async def authenticate(self, authorization: str | None) -> Principal | None:
        """The request's principal; None when no key is configured; raises a 401 APIError."""
        try:
            if not await self.required():
                return None
            scheme, _, key = (authorization or "").partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                raise invalid_api_key("Missing API key: send `Authorization: Bearer <key>`.")
            principal = await self.lookup(key.strip())
        except (RedisError, OSError) as exc:
            raise APIError(503, f"Cannot check the API key: Redis does not answer ({exc!r}).",
                           error_type="service_unavailable") from exc
        if principal is None:
            raise invalid_api_key("Incorrect API key provided.")
        return principal


class ApiKeyAuth:
    """ASGI middleware: authenticates `/v1/*` and puts the Principal in `request.state.principal`
    (None when keys are off). It answers (401, or 503 when Redis is silent) before the body is
    read, so the answer waits for the body to be drained, like the 413's."""

    def __init__(self, app: ASGIApp, store: ApiKeyStore):
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith(PROTECTED_PREFIX)
                                           or path in PROTECTED_PATHS):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        try:
            principal = await self.store.authenticate(authorization)
        except APIError as exc:  # sent once the unread body is drained (early_answer.py)
            await UnreadBody(scope, receive, send).answer(exc.response(), scope)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


# ---- management (`kvfleet keys`), synchronous --------------------------------------------------

def create_key(redis, keys: Keys, name: str = "", rpm: int | None = None,
               tpm: int | None = None) -> tuple[ApiKeyRecord, str]:
    """Store a new key's hash; returns its record and the plaintext (shown once, never stored)."""
    key_id, plaintext = new_key()
    record = ApiKeyRecord(key_id, name, rpm, tpm, round(time.time(), 3))
    redis.hset(keys.api_keys(), api_key_field(plaintext), record.encode())
    return record, plaintext


def list_keys(redis, keys: Keys) -> list[ApiKeyRecord]:
    records = [ApiKeyRecord.decode(raw) for raw in redis.hvals(keys.api_keys())]
    return sorted(records, key=lambda r: r.created)


def revoke_key(redis, keys: Keys, key_id: str) -> bool:
    """Delete the key with id `key_id` (and its rate-limit state); False if there is none."""
    for digest, raw in redis.hgetall(keys.api_keys()).items():
        if ApiKeyRecord.decode(raw).id == key_id:
            redis.hdel(keys.api_keys(), digest)
            redis.delete(keys.rate_limit(key_id, "req"), keys.rate_limit(key_id, "tok"))
            return True
    return False
