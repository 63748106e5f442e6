"""Host copies of swapped-out streams' KV blocks: the engine's side of `--preemption swap`, and
where a stream handed over by another engine waits for blocks (moves.py); and `Swapping`, their
part of the engine's step lifecycle (lifecycle.py)."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from kvfleet.worker.engine.memory.device import is_cuda
from kvfleet.worker.engine.memory.kv_cache import HostBlocks, KVCachePool
from kvfleet.worker.engine.core.lifecycle import Feature, Samples
from kvfleet.worker.engine.core.model_runner import StepLogits
from kvfleet.worker.engine.core.preemption import PreemptionCostModel
from kvfleet.worker.engine.core.scheduler import SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence


class SwapFollower(Protocol):
    """A second pool whose KV follows the same block ids (a draft model's, speculation/draft.py):
    host copies it holds go into a stream's new blocks with the stream's own."""

    def swap_in(self, req_id: str, blocks: list[int]) -> int: ...

    def discard(self, req_id: str) -> None: ...

    @property
    def num_held_bytes(self) -> int: ...


class SwappedKV:
    """req_id -> the host copy of its blocks, while the scheduler holds the stream swapped out
    (preempted here, or handed over with its KV: `hold`)."""

    def __init__(self, pool: KVCachePool, preemption: PreemptionCostModel):
        self.pool = pool
        self.preemption = preemption  # observes every swap's bytes per second
        self.held: dict[str, HostBlocks] = {}
        self.followers: list[SwapFollower] = []

    def apply(self, sched: SchedulerOutput) -> None:
        """Copy preempted streams' blocks out (before this step may overwrite them), then copy
        readmitted streams' blocks back in."""
        if not (sched.swap_out or sched.swap_in):
            return
        start, moved = time.perf_counter(), 0
        for req_id, blocks in sched.swap_out:
            self.held[req_id] = host = self.pool.copy_out(blocks)
            moved += host.num_bytes
        for req_id, blocks in sched.swap_in:
            host = self.held.pop(req_id)
            self.pool.copy_in(host, blocks)
            moved += host.num_bytes
            for follower in self.followers:  # their leading blocks: they may cover fewer
                moved += follower.swap_in(req_id, blocks)
        if is_cuda(self.pool.device):
            torch.cuda.synchronize(self.pool.device)
        self.preemption.observe_swap(moved, time.perf_counter() - start)

    def hold(self, req_id: str, host: HostBlocks) -> None:
        """Keep a handed-over stream's copy until the scheduler swaps it in."""
        self.held[req_id] = host

    def take(self, req_id: str) -> HostBlocks:
        """Remove a swapped-out stream's copy (it is handed over)."""
        return self.held.pop(req_id)

    def discard(self, req_id: str) -> bool:
        """Drop the copies of a stream that left; whether there was one."""
        for follower in self.followers:
            follower.discard(req_id)
        return self.held.pop(req_id, None) is not None

    def num_bytes_of(self, req_id: str) -> int:
        host = self.held.get(req_id)
        return 0 if host is None else host.num_bytes

    @property
    def num_bytes(self) -> int:
        return sum(h.num_bytes for h in self.held.values()) + sum(
            f.num_held_bytes for f in self.followers)


class Swapping(Feature):
    """Swap copies before each forward; what the preemption cost model learns from each step; a
    leaving stream's copies dropped."""

    def __init__(self, swapped: SwappedKV):
        self.swapped = swapped

    def before_execute(self, sched: SchedulerOutput) -> None:
        self.swapped.apply(sched)

    def executed(self, sched: SchedulerOutput, step: StepLogits, samples: Samples,
                 start: float, seconds: float) -> None:
        prefill_tokens = sum(c.num_tokens - len(c.draft) for c in sched.chunks
                             if c.num_tokens - len(c.draft) > 1)
        self.swapped.preemption.observe_step(prefill_tokens, sched.num_batched_tokens, seconds)

    def leave(self, seq: Sequence) -> None:
        self.swapped.discard(seq.req_id)
