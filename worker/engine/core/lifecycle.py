"""The one step lifecycle every engine feature plugs into (speculation, LoRA, tensor parallelism,
swapping, the pace), and the registry that calls them in order.

A request is **added** (a feature may refuse it with a ValueError; one that took something
gives it back when a later part refuses the request: **refused**). Each step:

1. **prepare**: before scheduling (adapters that found room get loaded; requests whose adapter
   failed are returned and fail);
2. **lookahead**: slots a decoding stream asks for beyond its next token (speculation);
3. the scheduler forms the step and asks each feature to **attach** its part to the chunks
   (proposals, adapter slots); the output is built once from them and not changed after;
4. **scheduled**: the step's output as built (who was preempted);
5. **before_execute**: before the forward, whether or not it runs (swap copies; the step sent
   to the other tensor-parallel ranks);
6. **execute**: one feature may run the forward itself (rank 0 of a tensor-parallel group);
   else the engine's model runner does;
7. **executed**: what the step took and gave (its time, each chunk's samples);
8. **emitted**: the tokens each stream got.

A request **leaves** once (finished, failed, aborted or handed over). A running sequence moved
to another engine (handoff.py, moves.py): a feature may forbid it (**handoff_gap**), adds its
part to the layout the other engine must match (**handoff_layout**), the bytes it moves
(**kv_bytes**), its part of the state (**export**), and checks and takes its part of an
incoming one (**check_import** before the request enters, **take_import** after). **stats** and
**report** add to the engine's stats and KV budget report; **close** stops what it started.

Every hook of `Feature` does nothing; a feature overrides the ones it needs, and `Features` calls
each hook only on the features that override it, in registration order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet.worker.engine.core.scheduler import Attachments, ScheduledChunk, SchedulerOutput, TokenEmission
from kvfleet.worker.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from kvfleet.worker.engine.core.handoff import SequenceState
    from kvfleet.worker.engine.core.model_runner import StepLogits
    from kvfleet.worker.engine.core.scheduler import Scheduler

Samples = dict[str, list[tuple[int, Any]]]  # req_id -> its new (token id, logprob) samples


class Feature:
    """One feature's part of the engine's lifecycle (every hook a no-op here)."""

    def add(self, seq: Sequence) -> None:
        """A request enters; raise a ValueError (nothing taken) to refuse it."""

    def refused(self, seq: Sequence) -> None:
        """A later part refused the request after `add`: give back what `add` took."""

    def prepare(self) -> list[tuple[str, Exception]]:
        """Before scheduling; the requests (by id) that failed meanwhile."""
        return []

    def lookahead(self, scheduler: Scheduler) -> dict[str, int] | None:
        """req_id -> slots a decoding stream asks for beyond its next token."""
        return None

    def attach(self, chunks: list[ScheduledChunk]) -> Attachments | None:
        """What this feature attaches to the step's chunks."""
        return None

    def scheduled(self, sched: SchedulerOutput) -> None:
        """The step's output, as built."""

    def before_execute(self, sched: SchedulerOutput) -> None:
        """Before the forward (also for a step with nothing to run)."""

    def execute(self, sched: SchedulerOutput) -> StepLogits | None:
        """Run the step's forward here (None: not this feature's to run)."""
        return None

    def executed(self, sched: SchedulerOutput, step: StepLogits, samples: Samples,
                 start: float, seconds: float) -> None:
        """The step ran: from `start` (perf_counter) for `seconds`, sampled `samples`."""

    def emitted(self, emissions: list[TokenEmission]) -> None:
        """The step's new tokens, per stream."""

    def leave(self, seq: Sequence) -> None:
        """The request left the engine (finished, failed, aborted or handed over)."""

    def handoff_gap(self) -> str | None:
        """Why no sequence can move to or from this engine (None: they can)."""
        return None

    def handoff_layout(self) -> dict:
        """This feature's part of what an engine taking this one's sequences must match."""
        return {}

    def kv_bytes(self, seq: Sequence) -> int:
        """Bytes of this feature's KV that an export of `seq` would move now."""
        return 0

    def export(self, seq: Sequence, table: list[int] | None) -> dict:
        """This feature's fields of the leaving sequence's state (`table`: its blocks; None when
        it is swapped out)."""
        return {}

    def check_import(self, state: SequenceState) -> None:
        """An incoming sequence: HandoffError when this feature's part of it does not fit here."""

    def take_import(self, state: SequenceState) -> None:
        """An incoming sequence, checked and entered: take this feature's part of it."""

    def stats(self) -> dict:
        """This feature's fields of the engine's stats (reports.EngineStats)."""
        return {}

    def report(self) -> list[str]:
        """Lines for the engine's KV budget report."""
        return []

    def close(self) -> None:
        """The engine closes."""


_HOOKS = ("add", "refused", "prepare", "lookahead", "attach", "scheduled", "before_execute",
          "execute", "executed", "emitted", "leave", "handoff_gap", "handoff_layout",
          "kv_bytes", "export", "check_import", "take_import", "stats", "report", "close")


class Features:
    """The engine's features in registration order; each hook called on those overriding it."""

    def __init__(self, features: list[Feature]):
        self.all = list(features)
        self._by_hook = {hook: [f for f in self.all
                                if getattr(type(f), hook) is not getattr(Feature, hook)]
                         for hook in _HOOKS}

    def add(self, seq: Sequence) -> None:
        taken: list[Feature] = []
        try:
            for feature in self._by_hook["add"]:
                feature.add(seq)
                taken.append(feature)
        except BaseException:
            self.refused(seq, taken)
            raise

    def refused(self, seq: Sequence, among: list[Feature] | None = None) -> None:
        for feature in self._by_hook["refused"]:
            if among is None or feature in among:
                feature.refused(seq)

    def prepare(self) -> list[tuple[str, Exception]]:
        return [failed for f in self._by_hook["prepare"] for failed in f.prepare()]

    def lookahead(self, scheduler: Scheduler) -> dict[str, int] | None:
        wanted: dict[str, int] | None = None
        for feature in self._by_hook["lookahead"]:
            asked = feature.lookahead(scheduler)
            if asked is not None:
                wanted = asked if wanted is None else {**wanted, **asked}
        return wanted

    @property
    def attaches(self) -> bool:
        return bool(self._by_hook["attach"])

    def attach(self, chunks: list[ScheduledChunk]) -> Attachments:
        extras = Attachments()
        for feature in self._by_hook["attach"]:
            extras = extras.merged(feature.attach(chunks))
        return extras

    def scheduled(self, sched: SchedulerOutput) -> None:
        for feature in self._by_hook["scheduled"]:
            feature.scheduled(sched)

    def before_execute(self, sched: SchedulerOutput) -> None:
        for feature in self._by_hook["before_execute"]:
            feature.before_execute(sched)

    def execute(self, sched: SchedulerOutput) -> StepLogits | None:
        for feature in self._by_hook["execute"]:
            step = feature.execute(sched)
            if step is not None:
                return step
        return None

    def executed(self, sched: SchedulerOutput, step: StepLogits, samples: Samples,
                 start: float, seconds: float) -> None:
        for feature in self._by_hook["executed"]:
            feature.executed(sched, step, samples, start, seconds)

    def emitted(self, emissions: list[TokenEmission]) -> None:
        for feature in self._by_hook["emitted"]:
            feature.emitted(emissions)

    def leave(self, seq: Sequence) -> None:
        for feature in self._by_hook["leave"]:
            feature.leave(seq)

    def handoff_gap(self) -> str | None:
        return next((gap for f in self._by_hook["handoff_gap"]
                     if (gap := f.handoff_gap()) is not None), None)

    def handoff_layout(self) -> dict:
        return {k: v for f in self._by_hook["handoff_layout"]
                for k, v in f.handoff_layout().items()}

    def kv_bytes(self, seq: Sequence) -> int:
        return sum(f.kv_bytes(seq) for f in self._by_hook["kv_bytes"])

    def export(self, seq: Sequence, table: list[int] | None) -> dict:
        return {k: v for f in self._by_hook["export"] for k, v in f.export(seq, table).items()}

    def check_import(self, state: SequenceState) -> None:
        for feature in self._by_hook["check_import"]:
            feature.check_import(state)

    def take_import(self, state: SequenceState) -> None:
        for feature in self._by_hook["take_import"]:
            feature.take_import(state)

    def stats(self) -> dict:
        return {k: v for f in self._by_hook["stats"] for k, v in f.stats().items()}

    def report(self) -> list[str]:
        return [line for f in self._by_hook["report"] for line in f.report()]

    def close(self) -> None:
        for feature in self._by_hook["close"]:
            feature.close()
