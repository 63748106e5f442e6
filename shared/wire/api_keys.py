"""An API key as Redis keeps it: one field of the `Keys.api_keys()` hash, named by the SHA-256 hex
of the plaintext key (never stored), holding this record as JSON. The gateway reads it on every
`/v1` request; `kvfleet keys` writes it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass
class ApiKeyRecord:
    id: str  # public: logs, `kvfleet keys list`, the rate-limit keys
    name: str = ""
    rpm: int | None = None  # requests per minute; None = the gateway's default
    tpm: int | None = None  # tokens (prompt + max_tokens) per minute; None = the default
    created: float = 0.0  # unix time

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> ApiKeyRecord:
        return cls(**json.loads(raw))


def api_key_field(plaintext_key: str) -> str:
    """The hash field of a key: SHA-256 hex of the plaintext."""
    return hashlib.sha256(plaintext_key.encode()).hexdigest()
