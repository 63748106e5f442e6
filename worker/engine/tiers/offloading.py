"""The prefix cache's second tier in host memory (`--kv-offloading-size`, vLLM's spelling): the
bytes of blocks evicted from the KV pool, kept by block hash (kv_tier.py's index), and
`Offloading`, its part of the engine's step lifecycle (lifecycle.py).

A cached block the pool evicts is copied here as it is evicted (the pool's own storage codes: an
8-bit pool's blocks stay 8-bit, with their scales); a waiting request whose prefix continues in
the tier gets those blocks back in fresh pool blocks, copied in before its step's forward, and
counts them as cached (block_manager.py), so it computes only the rest. A block brought back
holds the bytes it was evicted with: answers are the same, bit for bit, as if it never left.

The tier is one allocation, block-major ([slots, layers, 2, KV heads, block size, head dim]) so
each slot is contiguous; its size is fixed at start-up and never grows. On CUDA it is pinned and
every copy is queued on the compute stream without the host waiting (`non_blocking`): the stream
runs them in order before the step's kernels. On the CPU it is plain memory beside the pool's
budget (pages are touched as slots fill), and the copies are memcpy.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from kvfleet.worker.engine.memory.device import is_cuda
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, format_bytes
from kvfleet.worker.engine.memory.kv_tier import TierIndex
from kvfleet.worker.engine.core.lifecycle import Feature
from kvfleet.worker.engine.core.scheduler import SchedulerOutput

GIB = 1 << 30


class HostTier:
    """Slots in host memory for evicted pool blocks, and the copies between the two."""

    SETTING = "kv_offloading_size"

    def __init__(self, pool: KVCachePool, size_bytes: int):
        self.pool = pool
        capacity = size_bytes // pool.block_bytes
        if capacity < 1:
            raise ValueError(f"{self.SETTING} ({format_bytes(size_bytes)}) holds no KV block "
                             f"of {pool.block_bytes:,} bytes")
        self._async = self._copies_async()
        values, scales = pool.block_range(0, 1)
        self.values = self._slots(capacity, values, "values")
        self.scales = None if scales is None else self._slots(capacity, scales, "scales")
        self.index = TierIndex(capacity, self._save)
        self.disk: DiskTier | None = None  # the tier behind this one (`--kv-offloading-disk`)

    def _copies_async(self) -> bool:
        return is_cuda(self.pool.device)  # pinned, and copies queued without waiting

    def _slots(self, capacity: int, like: torch.Tensor, name: str) -> torch.Tensor:
        """[capacity, layers, 2, KVH, ...]: one contiguous slot per block."""
        shape = (capacity, *like.shape[:3], *like.shape[4:])
        return torch.empty(shape, dtype=like.dtype, pin_memory=self._async)

    @property
    def capacity_blocks(self) -> int:
        return self.index.capacity_blocks

    @property
    def num_bytes(self) -> int:
        """Host memory the tier holds (allocated once: its capacity)."""
        return self.capacity_blocks * self.pool.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks it holds now."""
        return len(self.index) * self.pool.block_bytes

    def _save(self, block: int, slot: int) -> None:
        values, scales = self.pool.block_range(block, 1)
        self.values[slot:slot + 1].copy_(values.movedim(3, 0), non_blocking=self._async)
        if scales is not None:
            self.scales[slot:slot + 1].copy_(scales.movedim(3, 0), non_blocking=self._async)

    def load(self) -> int:
        """Copy this step's restored blocks into the pool; how many."""
        loads = self.index.take_loads()
        for slot, block, count in paired_runs(loads):
            values, scales = self.pool.block_range(block, count)
            values.copy_(self._to_device(self.values[slot:slot + count]).movedim(0, 3))
            if scales is not None:
                scales.copy_(self._to_device(self.scales[slot:slot + count]).movedim(0, 3))
        return len(loads)

    def _to_device(self, slots: torch.Tensor) -> torch.Tensor:
        """Contiguous slots on the pool's device: on CUDA one asynchronous copy from pinned
        memory (the strided write into the pool follows on the device); on the CPU the slots
        themselves, no copy."""
        return slots.to(self.pool.device, non_blocking=self._async)


class DiskTier(HostTier):
    """The tier behind the host tier (`--kv-offloading-disk`): slots in a file in a directory,
    memory-mapped, which take the blocks the host tier drops for room (copied from the host slot
    as it is reused) and give them back to the pool as the host tier does (read at the step's
    `before_execute`). The file is unlinked as soon as it is mapped: its space is the worker's
    while it runs and is freed when it exits, however it exits; nothing outlives the process
    (a cache, not a store). The kernel writes its pages back to the disk and reads them in on
    demand, so the tier costs page cache, not the worker's memory."""

    SETTING = "kv_offloading_disk_size"

    def __init__(self, pool: KVCachePool, size_bytes: int, directory: str, host: HostTier):
        self.directory, self.host = directory, host
        if not os.path.isdir(directory):
            raise ValueError(f"kv_offloading_disk: {directory!r} is not a directory")
        super().__init__(pool, size_bytes)

    def _copies_async(self) -> bool:
        return False  # a mapped file is not pinned memory

    def _slots(self, capacity: int, like: torch.Tensor, name: str) -> torch.Tensor:
        shape = (capacity, *like.shape[:3], *like.shape[4:])
        itemsize = like.element_size()  # mapped as bytes (numpy has no bfloat16), viewed back
        raw_shape = (*shape[:-1], shape[-1] * itemsize)
        handle, path = tempfile.mkstemp(prefix=f"kvfleet-kv-{name}-", suffix=".bin",
                                        dir=self.directory)
        try:
            os.ftruncate(handle, int(np.prod(raw_shape)))
            mapped = np.memmap(path, dtype=np.uint8, mode="r+", shape=raw_shape)
        finally:
            os.close(handle)
            os.unlink(path)  # the mapping keeps the space while the process lives
        return torch.from_numpy(mapped).view(like.dtype)

    def _save(self, host_slot: int, slot: int) -> None:
        """The host tier reuses `host_slot`: its bytes to disk slot `slot` first."""
        self.values[slot].copy_(self.host.values[host_slot])
        if self.scales is not None:
            self.scales[slot].copy_(self.host.scales[host_slot])

    def report_line(self) -> str:
        tokens = self.capacity_blocks * self.pool.block_size
        return (f"disk tier (--kv-offloading-disk {self.directory}): "
                f"{format_bytes(self.num_bytes)} = {self.capacity_blocks} blocks "
                f"({tokens:,} tokens) of prefixes the host tier dropped, memory-mapped")


def paired_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first a, first b, count) of each run of pairs whose a and b both go up by one, in the
    order of b: one copy per run instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for a, b in sorted(pairs, key=lambda pair: pair[1]):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


class Offloading(Feature):
    """Restored blocks copied in before each forward (registered after swapping: a preempted
    stream's blocks are read before anything is written into the pool); the tier's stats and
    budget line."""

    def __init__(self, tier: HostTier, disk: DiskTier | None = None):
        self.tier, self.disk = tier, disk

    def before_execute(self, sched: SchedulerOutput) -> None:
        self.tier.load()
        if self.disk is not None:
            self.disk.load()

    def stats(self) -> dict:
        index = self.tier.index
        stats = {"kv_offload_capacity_bytes": self.tier.num_bytes,
                 "kv_offload_used_bytes": self.tier.used_bytes,
                 "kv_offloaded_blocks": index.num_offloaded_blocks,
                 "kv_offload_evicted_blocks": index.num_evicted_blocks,
                 "kv_offload_restored_blocks": index.num_restored_blocks}
        if self.disk is not None:
            disk = self.disk.index
            stats.update({"kv_disk_capacity_bytes": self.disk.num_bytes,
                          "kv_disk_used_bytes": self.disk.used_bytes,
                          "kv_disk_spilled_blocks": disk.num_offloaded_blocks,
                          "kv_disk_evicted_blocks": disk.num_evicted_blocks,
                          "kv_disk_restored_blocks": disk.num_restored_blocks})
        return stats

    def report(self) -> list[str]:
        tier = self.tier
        tokens = tier.capacity_blocks * tier.pool.block_size
        lines = [f"host tier (--kv-offloading-size): {format_bytes(tier.num_bytes)} = "
                 f"{tier.capacity_blocks} blocks ({tokens:,} tokens) of evicted prefixes"
                 + (", pinned" if is_cuda(tier.pool.device) else "")]
        return lines + ([] if self.disk is None else [self.disk.report_line()])
