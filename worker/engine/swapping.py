"""Host copies of swapped-out streams' KV blocks: the engine's side of `--preemption swap`, and
where a stream handed over by another engine waits for blocks (handoff.py)."""

from __future__ import annotations

import time

import torch

from worker.engine.device import is_cuda
from worker.engine.kv_cache import HostBlocks, KVCachePool
from worker.engine.preemption import PreemptionCostModel
from worker.engine.scheduler import SchedulerOutput


class SwappedKV:
    """req_id -> the host copy of its blocks, while the scheduler holds the stream swapped out
    (preempted here, or handed over with its KV: `hold`)."""

    def __init__(self, pool: KVCachePool, preemption: PreemptionCostModel,
                 draft_pool: KVCachePool | None = None):
        self.pool = pool
        self.draft_pool = draft_pool  # a draft model's, with the same block ids
        self.preemption = preemption  # observes every swap's bytes per second
        self.held: dict[str, HostBlocks] = {}
        # a handed-over stream's draft KV (a preemption keeps none: the draft computes it again)
        self.draft_held: dict[str, HostBlocks] = {}

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
            draft = self.draft_held.pop(req_id, None)
            if draft is not None:  # its leading blocks: the draft's KV may cover fewer positions
                self.draft_pool.copy_in(draft, blocks[:draft.num_blocks])
                moved += draft.num_bytes
        if is_cuda(self.pool.device):
            torch.cuda.synchronize(self.pool.device)
        self.preemption.observe_swap(moved, time.perf_counter() - start)

    def hold(self, req_id: str, host: HostBlocks, draft: HostBlocks | None = None) -> None:
        """Keep a handed-over stream's copies until the scheduler swaps it in."""
        self.held[req_id] = host
        if draft is not None:
            self.draft_held[req_id] = draft

    def take(self, req_id: str) -> tuple[HostBlocks, HostBlocks | None]:
        """Remove a swapped-out stream's copies (it is handed over): its blocks', its draft's."""
        return self.held.pop(req_id), self.draft_held.pop(req_id, None)

    def discard(self, req_id: str) -> bool:
        """Drop the copies of a stream that left; whether there was one."""
        self.draft_held.pop(req_id, None)
        return self.held.pop(req_id, None) is not None

    def num_bytes_of(self, req_id: str) -> int:
        return sum(h.num_bytes for h in (self.held.get(req_id), self.draft_held.get(req_id))
                   if h is not None)

    @property
    def num_bytes(self) -> int:
        return sum(h.num_bytes for h in (*self.held.values(), *self.draft_held.values()))
