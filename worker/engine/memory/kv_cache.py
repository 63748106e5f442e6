"""The KV block pool: its memory budget, its preallocated tensors and the operator's budget lines."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from kvfleet.worker.engine.memory.device import is_cpu, is_cuda
from kvfleet.worker.engine.memory.kv_format import SCALE_DTYPE, KVFormat, rotation_matrix

GB = 1e9


def format_bytes(num_bytes: int) -> str:
    """GB with two decimals (MB below 10 MB)."""
    return f"{num_bytes / GB:.2f} GB" if num_bytes >= 1e7 else f"{num_bytes / 1e6:.2f} MB"


# madvise(2) advice that faults every page of a range in, writable (Linux 5.14+); Python's mmap
# module names it from 3.13 on
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU in anonymous memory the kernel backs with 2 MB pages where it can
    (MADV_HUGEPAGE; transparent huge pages are often `madvise`-only). Decode attention reads each
    sequence's blocks at scattered places in the pool: with 4 KB pages nearly every block costs a
    TLB miss, and the C++ kernel reads K/V measurably faster from huge pages.

    Every page is faulted in here, at start-up, as torch.zeros would: otherwise the first write
    to each 2 MB page of the pool (a prefill's K/V) stops the step while the kernel clears that
    page (a visible share of a fresh worker's prefill steps), and a pool the machine
    cannot back would fail mid-request instead of at start-up."""
    if not is_cpu(device):
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = dtype.itemsize
    for size in shape:
        num_bytes *= size
    # private anonymous memory, zero-filled (shared anonymous memory is shmem: no huge pages)
    memory = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)[:num_bytes]
    try:
        memory.madvise(MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: write the zeros, which faults the pages in as well
        tensor.zero_()
    return tensor.view(dtype).view(shape)


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_format: KVFormat

    @classmethod
    def from_model_config(cls, config, kv_format: KVFormat) -> KVLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, kv_format)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 x layers x kv_heads x (head_dim x bytes/elem
        + the row's scale, for 8-bit formats)."""
        return 2 * self.num_layers * self.num_kv_heads * self.kv_format.row_bytes(self.head_dim)


@dataclass(frozen=True)
class MemoryBudget:
    """How the KV pool was sized, in the terms an operator reasons in."""

    weights_bytes: int
    kv_bytes: int
    bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    source: str  # where the KV bytes came from
    kv_dtype: str = "fp32"  # the pool's storage format

    @property
    def tokens_that_fit(self) -> int:
        return self.num_blocks * self.block_size

    def report(self) -> list[str]:
        """The operator's budget lines (logged at start-up)."""
        tokens = self.tokens_that_fit
        lines = [
            f"weights: {format_bytes(self.weights_bytes)}",
            f"KV cache: {format_bytes(self.kv_bytes)} ({self.source}) = {self.num_blocks} blocks "
            f"x {self.block_size} tokens",
            f"KV bytes per token: {self.bytes_per_token:,} ({self.kv_dtype})",
            f"tokens that fit: {tokens:,}",
        ]
        for conv in (2048, 8192):
            note = "" if conv <= self.max_model_len else f" (beyond the {self.max_model_len}-token context)"
            lines.append(f"conversations of {conv // 1024}k tokens that fit: {tokens // conv}{note}")
        return lines


def model_weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()  # tied embeddings count once
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def plan_budget(model: torch.nn.Module, layout: KVLayout, block_size: int, max_model_len: int,
                device: torch.device, num_blocks: int | None, kv_memory_bytes: int,
                gpu_memory_utilization: float, activation_reserve_bytes: int = 0) -> MemoryBudget:
    """Size the pool: explicit `num_blocks`, else the CUDA card's total x utilisation less what is in
    use and the profiled step peak, else the CPU budget."""
    block_bytes = layout.bytes_per_token * block_size
    if num_blocks is not None:
        source = "num_blocks given"
    elif is_cuda(device):
        # utilisation is of the card's total: what is in use now (weights, the CUDA context, other
        # processes) and the peak of the largest step (activation_reserve_bytes, profiled) come off
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        in_use = total_bytes - free_bytes
        usable = int(total_bytes * gpu_memory_utilization) - in_use - activation_reserve_bytes
        num_blocks = usable // block_bytes
        source = (f"{gpu_memory_utilization:.0%} of {total_bytes / GB:.2f} GB - {in_use / GB:.2f} GB "
                  f"in use - {activation_reserve_bytes / GB:.2f} GB peak step")
    else:
        num_blocks = kv_memory_bytes // block_bytes
        source = f"kv_memory_bytes={kv_memory_bytes:,}"
    if num_blocks < 1:
        raise ValueError(f"the KV budget ({source}) holds no block of {block_bytes:,} bytes")
    return MemoryBudget(
        weights_bytes=model_weight_bytes(model), kv_bytes=num_blocks * block_bytes,
        bytes_per_token=layout.bytes_per_token, block_size=block_size, num_blocks=num_blocks,
        max_model_len=max_model_len, source=source, kv_dtype=layout.kv_format.name)


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first block, its index in `blocks`, count) of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(blocks):
        if runs and runs[-1][0] + runs[-1][2] == block:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((block, i, 1))
    return runs


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class HostBlocks:
    """Copies of some blocks' K/V (and scales) in host memory: a swapped-out sequence's cache."""

    values: torch.Tensor  # [layers, 2, KVH, n, block_size, D] storage codes
    scales: torch.Tensor | None  # [layers, 2, KVH, n, block_size]

    @property
    def num_blocks(self) -> int:
        return self.values.shape[3]

    @property
    def num_bytes(self) -> int:
        return tensor_bytes(self.values, self.scales)


class KVCachePool:
    """Preallocated K and V blocks of every layer, stored in the layout's format.

    `layer(i)`: [2, num_kv_heads, num_blocks, block_size, head_dim] (K then V), head-major so that
    gathering a batch's blocks yields [2, kv_heads, B, L, head_dim] ready for attention without a
    further copy. Slot `s = block * block_size + offset` holds one token of one sequence. 8-bit
    formats keep one scale per (token, KV head) in a parallel tensor without the last dimension.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device):
        self.layout = layout
        self.kv_format = layout.kv_format
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        shape = (layout.num_layers, 2, layout.num_kv_heads, num_blocks, block_size, layout.head_dim)
        self._storage = _zeros(shape, self.kv_format.storage, device)
        self._scales = (torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)
                        if self.kv_format.is_quantized else None)
        # host copies are pinned when the pool is on an accelerator, so swaps can overlap
        self._pin = is_cuda(device)
        self._rotation = (rotation_matrix(layout.head_dim).to(device)
                          if self.kv_format.rotate else None)
        self._rotations: dict[torch.dtype, torch.Tensor] = {}

    def rotation(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[D, D] matrix R the rows are stored rotated by (cached rows hold x @ R), or None."""
        if self._rotation is None:
            return None
        if dtype not in self._rotations:
            self._rotations[dtype] = self._rotation.to(dtype)
        return self._rotations[dtype]

    def layer(self, index: int) -> torch.Tensor:
        return self._storage[index]

    def scales(self, index: int) -> torch.Tensor | None:
        """[2, num_kv_heads, num_blocks, block_size] scales of one layer (8-bit formats), or None."""
        return None if self._scales is None else self._scales[index]

    @property
    def num_bytes(self) -> int:
        return tensor_bytes(self._storage, self._scales)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer (what a swap moves per block)."""
        return self.num_bytes // self.num_blocks

    # ---- attention's reads and writes ---------------------------------------------------------

    def write(self, layer: int, slot_rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new K and V rows ([KVH * T, D] each) at rows `slot_rows` (h * slots + slot)."""
        _, kv_heads, num_blocks, block_size, head_dim = self._storage.shape[1:]
        by_slot = self._storage[layer].view(2, kv_heads * num_blocks * block_size, head_dim)
        scales = None if self._scales is None else self._scales[layer].view(2, -1)
        rotation = self.rotation(torch.float32)
        for i, rows in enumerate((key, value)):
            if rotation is not None:
                rows = rows.float() @ rotation
            codes, scale = self.kv_format.quantize(rows)
            by_slot[i].index_copy_(0, slot_rows, codes)
            if scales is not None:
                scales[i].index_copy_(0, slot_rows, scale)

    def gather(self, layer: int, block_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the [2 * KVH * num_blocks] block view -> [R, block_size * D] values in `dtype`
        (still rotated when the format rotates: see `rotation`)."""
        _, kv_heads, num_blocks, block_size, head_dim = self._storage.shape[1:]
        by_block = self._storage[layer].view(2 * kv_heads * num_blocks, block_size * head_dim)
        codes = by_block.index_select(0, block_rows)
        if self._scales is None:
            return codes.to(dtype)
        scales = self._scales[layer].view(2 * kv_heads * num_blocks, block_size)
        rows = codes.view(-1, block_size, head_dim)
        values = self.kv_format.dequantize(rows, scales.index_select(0, block_rows), dtype)
        return values.view(-1, block_size * head_dim)

    def block_range(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of blocks `[start, start + count)` in every layer: values
        [layers, 2, KVH, count, block_size, D] and scales (8-bit formats; else None)."""
        return (self._storage[:, :, :, start:start + count],
                None if self._scales is None else self._scales[:, :, :, start:start + count])

    # ---- swapping -----------------------------------------------------------------------------

    def copy_out(self, blocks: list[int]) -> HostBlocks:
        """Copy `blocks` (every layer, K and V, scales) to host memory."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        return HostBlocks(self._to_host(self._storage.index_select(3, index)),
                          None if self._scales is None
                          else self._to_host(self._scales.index_select(3, index)))

    def copy_in(self, host: HostBlocks, blocks: list[int]) -> None:
        """Write host copies back into `blocks` (as many as were copied out)."""
        if len(blocks) != host.num_blocks:
            raise ValueError(f"{host.num_blocks} blocks swapped out, {len(blocks)} to fill")
        if is_cpu(self.device):
            # one copy per run of consecutive blocks: twice as fast as index_copy_ along the
            # block dimension on the CPU, and a swap-in (or a handoff's) stalls its step
            for start, first, count in _runs(blocks):
                self._storage[:, :, :, start:start + count].copy_(
                    host.values[:, :, :, first:first + count])
                if self._scales is not None:
                    self._scales[:, :, :, start:start + count].copy_(
                        host.scales[:, :, :, first:first + count])
            return
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        self._storage.index_copy_(3, index, host.values.to(self.device, non_blocking=True))
        if self._scales is not None:
            self._scales.index_copy_(3, index, host.scales.to(self.device, non_blocking=True))

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cpu:
            return tensor  # index_select already made a copy
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
        host.copy_(tensor)
        return host
