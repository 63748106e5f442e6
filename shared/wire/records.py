"""The records one request leaves in Redis besides its checkpoint: its entry in a request stream,
its hash, and its dead-letter entry. Each class owns its field names; the Lua scripts take them
from here (shared/wire/scripts.py), so no field name is written twice.

Redis hands values back as bytes; `decode` accepts bytes or str keys and values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvfleet.shared.wire.messages import GenerationRequest
from kvfleet.shared.wire.status import RequestStatus

RawFields = Mapping[bytes | str, bytes | str]


def text(value: bytes | str | None) -> str:
    """A Redis value as str ('' for a missing one)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def field_value(raw: RawFields, name: str) -> bytes | str | None:
    """One field of a hash or stream entry, whichever type its keys have."""
    value = raw.get(name.encode())
    return raw.get(name) if value is None else value


@dataclass(frozen=True)
class QueueEntry:
    """One entry of a request stream (`Keys.queue`). The prompt length is a plain field beside the
    packed request so the admission script (`READ_IF_FITS`) can test the fit without msgpack."""

    ID: ClassVar[str] = "id"
    PAYLOAD: ClassVar[str] = "payload"  # GenerationRequest.pack()
    PROMPT_LEN: ClassVar[str] = "prompt_len"  # prompt tokens, decimal
    # In a worker's own stream: the prompt tokens the router expects that worker to find in its
    # prefix cache (decimal); its admission counts only the rest (READ_IF_FITS, `use_cached`).
    CACHED: ClassVar[str] = "cached"

    request: GenerationRequest
    cached_tokens: int = 0

    def encode(self) -> dict[str, bytes | str | int]:
        """The XADD field mapping (what the ENQUEUE script writes, for callers without it)."""
        fields: dict[str, bytes | str | int] = {
            self.ID: self.request.req_id, self.PAYLOAD: self.request.pack(),
            self.PROMPT_LEN: len(self.request.prompt_token_ids)}
        if self.cached_tokens:
            fields[self.CACHED] = self.cached_tokens
        return fields

    @classmethod
    def decode(cls, raw: RawFields) -> QueueEntry:
        payload = field_value(raw, cls.PAYLOAD)
        if payload is None:
            raise ValueError("a request stream entry without a payload")
        cached = text(field_value(raw, cls.CACHED))
        return cls(GenerationRequest.unpack(payload), int(cached) if cached.isdigit() else 0)


@dataclass(frozen=True)
class RequestRecord:
    """The request hash (`Keys.request`): what was asked, the fencing token and the status.

    `attempt` is incremented by each worker that starts the request (START_ATTEMPT); a worker
    whose attempt is no longer the hash's stops (PUBLISH writes nothing for it)."""

    PAYLOAD: ClassVar[str] = "payload"  # GenerationRequest.pack()
    ATTEMPT: ClassVar[str] = "attempt"  # integer, 0 until a worker starts the request
    STATUS: ClassVar[str] = "status"  # RequestStatus value
    WORKER: ClassVar[str] = "worker"  # id of the worker of the current attempt
    # "1" once a reader attached by id (ATTACH): events then also go to the request's own
    # channel (Keys.tokens), beside its inbox
    WATCHED: ClassVar[str] = "watched"
    # the numerics fingerprints of the workers that produced the checkpoint's tokens, in order,
    # joined by "+" (START_ATTEMPT / START_HANDOFF: a resume on other numerics appends its own)
    NUMERICS: ClassVar[str] = "numerics"
    SNAPSHOT_FIELDS: ClassVar[tuple[str, str, str]] = (PAYLOAD, STATUS, ATTEMPT)

    request: GenerationRequest
    attempt: int = 0
    status: RequestStatus = RequestStatus.QUEUED
    worker: str = ""

    def encode(self) -> dict[str, bytes | str | int]:
        """The HSET mapping (the ENQUEUE script writes the same for a new request)."""
        data: dict[str, bytes | str | int] = {self.PAYLOAD: self.request.pack(),
                                              self.ATTEMPT: self.attempt,
                                              self.STATUS: self.status.value}
        if self.worker:
            data[self.WORKER] = self.worker
        return data

    @classmethod
    def decode_snapshot(cls, payload: bytes | None, status: bytes | None,
                        attempt: bytes | None) -> RequestRecord | None:
        """The record from HMGET of SNAPSHOT_FIELDS; None when the request is unknown or expired.
        An unknown status reads as queued (a newer writer may know more states)."""
        if payload is None:
            return None
        try:
            request_status = RequestStatus(text(status) or RequestStatus.QUEUED.value)
        except ValueError:
            request_status = RequestStatus.QUEUED
        return cls(GenerationRequest.unpack(payload), int(attempt or 0), request_status)


@dataclass(frozen=True)
class DeadLetterEntry:
    """One entry of a model's dead-letter stream (`Keys.dead_letter`): a request delivered too
    many times, kept for an operator."""

    ID: ClassVar[str] = "id"
    PAYLOAD: ClassVar[str] = "payload"
    ERROR: ClassVar[str] = "error"
    WORKER: ClassVar[str] = "worker"
    MAXLEN: ClassVar[int] = 10_000  # the stream is capped (approximately) at this many entries

    request: GenerationRequest
    error: str
    worker: str

    def encode(self) -> dict[str, bytes | str]:
        return {self.ID: self.request.req_id, self.PAYLOAD: self.request.pack(),
                self.ERROR: self.error, self.WORKER: self.worker}

    @classmethod
    def decode(cls, raw: RawFields) -> DeadLetterEntry:
        return cls(GenerationRequest.unpack(field_value(raw, cls.PAYLOAD)),
                   text(field_value(raw, cls.ERROR)), text(field_value(raw, cls.WORKER)))
