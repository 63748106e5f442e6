"""Rank 0's side of a tensor-parallel step, as a feature of the engine's step lifecycle
(lifecycle.py): send the step to the other ranks before the forward, then run rank 0's share.

The other ranks' side is `tp_rank.follow`. A failure here may leave the ranks out of step, so it
ends the worker (RankFailure, a DeviceFailure) instead of failing the batch's requests."""

from __future__ import annotations

import logging

from kvfleet.worker.engine.core.lifecycle import Feature
from kvfleet.worker.engine.core.model_runner import ModelRunner, StepLogits, StepPlan, StepRows, plan_step
from kvfleet.worker.engine.core.scheduler import SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.parallel.tp_group import RankFailure, RankGroup

log = logging.getLogger(__name__)


class RankSteps(Feature):
    """Rank 0 of a tensor-parallel group: every step (and its swap copies) goes to the other
    ranks before rank 0's own swap copies and forward; no handoff (each rank holds a share of
    the KV heads)."""

    def __init__(self, ranks: RankGroup, runner: ModelRunner, block_size: int):
        self.ranks, self.runner, self.block_size = ranks, runner, block_size
        self._planned: tuple[StepPlan, StepRows] | None = None  # this step's, sent

    def before_execute(self, sched: SchedulerOutput) -> None:
        plan, rows = plan_step(sched, self.block_size)
        self.ranks.send_step(plan, sched.swap_out, sched.swap_in)
        self._planned = plan, rows

    def execute(self, sched: SchedulerOutput) -> StepLogits:
        (plan, rows), self._planned = self._planned, None
        try:
            logits = self.runner.forward(plan, rows.prompt_indices)  # [K + P, vocab]
        except Exception as exc:
            log.critical("tensor-parallel forward failed on rank 0: %s", exc)
            raise RankFailure(f"{type(exc).__name__}: {exc}") from exc
        k = rows.num_logits
        return StepLogits(rows.emitting, logits[:k], rows.prompt_spans,
                          logits[k:] if rows.prompt_spans else None)

    def leave(self, seq: Sequence) -> None:
        """A swapped-out request that left: the ranks drop its host copies with the next step."""
        self.ranks.discard_swapped(seq.req_id)

    def handoff_gap(self) -> str | None:
        return "tensor parallelism (each rank holds a share of the KV heads)"

    def close(self) -> None:
        """Stop the other ranks."""
        if self.ranks.is_driver:
            self.ranks.stop()
