"""Host copies of swapped-out streams' KV blocks: the engine's side of `--preemption swap`."""

from __future__ import annotations

import time

import torch

from worker.engine.device import is_cuda
from worker.engine.kv_cache import HostBlocks, KVCachePool
from worker.engine.preemption import PreemptionCostModel
from worker.engine.scheduler import SchedulerOutput


class SwappedKV:
    """req_id -> the host copy of its blocks, while the scheduler holds the stream swapped out."""

    def __init__(self, pool: KVCachePool, preemption: PreemptionCostModel):
        self.pool = pool
        self.preemption = preemption  # observes every swap's bytes per second
        self.held: dict[str, HostBlocks] = {}

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
        if is_cuda(self.pool.device):
            torch.cuda.synchronize(self.pool.device)
        self.preemption.observe_swap(moved, time.perf_counter() - start)

    def discard(self, req_id: str) -> bool:
        """Drop an aborted stream's copy; whether there was one."""
        return self.held.pop(req_id, None) is not None

    @property
    def num_bytes(self) -> int:
        return sum(h.num_bytes for h in self.held.values())
