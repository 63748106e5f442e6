"""LoRA adapters in the engine's step lifecycle (lifecycle.py): a request's adapter pinned when
it enters (loaded, or waiting for room) and released when it leaves, pending adapters loaded
before each schedule, each chunk's device slot attached when the step is built (manager.py has
the adapters' life); an engine without --enable-lora refuses requests that name one."""

from __future__ import annotations

from kvfleet.worker.engine.core.lifecycle import Feature
from kvfleet.worker.engine.lora.manager import LoraManager
from kvfleet.worker.engine.core.lora_request import LoraLoadError
from kvfleet.worker.engine.core.scheduler import Attachments, ScheduledChunk
from kvfleet.worker.engine.core.sequence import Sequence


class Adapters(Feature):
    """The adapters of an engine with --enable-lora."""

    def __init__(self, manager: LoraManager):
        self.manager = manager

    def add(self, seq: Sequence) -> None:
        if seq.lora is not None:  # loaded (or waiting for room) and held from here
            self.manager.acquire(seq.req_id, seq.lora)

    def refused(self, seq: Sequence) -> None:
        self.manager.release(seq.req_id)

    def prepare(self) -> list[tuple[str, Exception]]:
        """Adapters that found room since: their requests may run."""
        return self.manager.load_pending()

    def attach(self, chunks: list[ScheduledChunk]) -> Attachments:
        slots, loads = self.manager.assign_slots(chunks)
        return Attachments(lora_slots=slots, lora_loads=tuple(loads))

    def leave(self, seq: Sequence) -> None:
        self.manager.release(seq.req_id)

    def report(self) -> list[str]:
        return [self.manager.report()]


class NoAdapters(Feature):
    """An engine without --enable-lora: a request naming an adapter is refused."""

    def add(self, seq: Sequence) -> None:
        if seq.lora is not None:
            raise LoraLoadError(f"request {seq.req_id!r} names adapter {seq.lora.name!r}, but "
                                "this engine serves no LoRA adapters (--enable-lora)")
