"""The engine client interface the gateway's handlers talk to, so they can run against a fake."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvfleet.shared.wire import GenerationRequest, RequestStatus, TokenEvent


class EngineError(Exception):
    """The fleet could not produce an answer; `status` is the HTTP status the client gets."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class EngineUnavailable(EngineError):
    """Redis does not answer (or dropped the connection): nothing can be enqueued or received."""


class EngineTimeout(EngineError):
    """No event arrived in time, or the request's deadline passed."""

    status = 504
    error_type = "timeout"


class WorkerError(EngineError):
    """A worker ended the request with `error` or `abort` (poison request, dead-lettered, ...)."""


class EventStream(ABC):
    """The token events of one submitted request, in arrival order (stale or repeated ones included:
    the consumer filters by attempt and seq). Iteration never ends by itself; the consumer stops
    after the final event and must call `aclose()` in every case."""

    def __aiter__(self) -> EventStream:
        return self

    @abstractmethod
    async def __anext__(self) -> TokenEvent:
        """The next event; raises EngineTimeout or EngineUnavailable."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop receiving this request's events (does not cancel the request). Must not block:
        it runs inside cancelled tasks, where any real await would be cancelled again."""


@dataclass
class RequestSnapshot:
    """A submitted request as Redis holds it: what was asked, how far it got, and its state."""

    request: GenerationRequest
    status: RequestStatus
    attempt: int
    token_ids: list[int] = field(default_factory=list)  # the checkpoint: output tokens so far


@dataclass
class QueueLoad:
    """How busy a model's fleet is: requests no worker took yet, the live workers' speed and
    their room at the pace they promise (gateway/fleet/pace.py)."""

    undelivered: int
    live_workers: int
    tokens_per_s: float
    pace_room: int = 0  # more streams the workers taking new requests start now at their pace
    pace_promised: bool = False  # some live worker promises a pace (else pace_room means nothing)


class EngineClient(ABC):
    """What the handlers need from the fleet: submit, cancel, readiness."""

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Open connections and background tasks (called from the app's lifespan)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release everything `start` opened."""

    def new_request_hex(self, prefix: str) -> str:
        """A fresh random hex for the id `prefix + hex` of a new request (an engine may pick
        ids that place the request well: RedisEngineClient's stream shard shares)."""
        del prefix
        return uuid.uuid4().hex

    @abstractmethod
    async def submit(self, request: GenerationRequest) -> EventStream:
        """Start receiving the request's events, then enqueue it (idempotent by request id).
        Raises EngineUnavailable when the fleet cannot take it."""

    @abstractmethod
    async def cancel(self, req_id: str) -> None:
        """Tell the workers that nobody waits for `req_id` any more."""

    @abstractmethod
    async def is_ready(self) -> bool:
        """True when the fleet's Redis answers."""


    async def attach(self, req_id: str) -> tuple[RequestSnapshot, EventStream] | None:
        """Subscribe to a submitted request's events, *then* read its snapshot (so no token falls
        between the two); None when the request is unknown or expired. Engines that keep no
        requests return None."""
        del req_id
        return None

    async def read_checkpoint(self, req_id: str) -> list[int]:
        """The output tokens checkpointed so far (to fill a gap in the events); [] if unknown.
        Raises EngineUnavailable when the fleet's store cannot be read."""
        del req_id
        return []

    async def queue_load(self, model: str) -> QueueLoad | None:
        """The model's queue and fleet throughput (for backpressure); None when unknown."""
        del model
        return None
