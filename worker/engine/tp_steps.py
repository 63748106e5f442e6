"""Rank 0's side of a tensor-parallel step: send the step to the other ranks, then run its share.

The other ranks' side is `tp_rank.follow`. A failure here may leave the ranks out of step, so it
ends the worker (RankFailure) instead of failing the batch's requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from worker.engine.model_runner import ModelRunner, StepLogits, plan_step
from worker.engine.scheduler import SchedulerOutput
from worker.engine.tp_group import RankFailure, RankGroup

log = logging.getLogger(__name__)


def forward_on_ranks(ranks: RankGroup, runner: ModelRunner, sched: SchedulerOutput,
                     block_size: int, swap: Callable[[SchedulerOutput], None]
                     ) -> tuple[StepLogits, float] | None:
    """The step's logits and when its forward started; None for a step with nothing to run.
    `swap` applies the step's swap copies to rank 0's pool (after the others were told)."""
    plan, rows = plan_step(sched, block_size)
    ranks.send_step(plan, sched.swap_out, sched.swap_in)
    swap(sched)
    if sched.is_empty:
        return None
    start = time.perf_counter()
    try:
        logits = runner.forward(plan, rows.prompt_indices)  # [K + P, vocab]
    except Exception as exc:
        log.critical("tensor-parallel forward failed on rank 0: %s", exc)
        raise RankFailure(f"{type(exc).__name__}: {exc}") from exc
    k = rows.num_logits
    step = StepLogits(rows.emitting, logits[:k], rows.prompt_spans,
                      logits[k:] if rows.prompt_spans else None)
    return step, start
