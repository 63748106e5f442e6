"""The KV block pool: its memory budget, its preallocated tensors and the operator's budget lines."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1e9

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def format_bytes(num_bytes: int) -> str:
    """GB with two decimals (MB below 10 MB)."""
    return f"{num_bytes / GB:.2f} GB" if num_bytes >= 1e7 else f"{num_bytes / 1e6:.2f} MB"


def resolve_device(name: str) -> torch.device:
    """'auto' -> the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on CPU (bf16 matmuls are slow on CPUs without AMX)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype) -> KVLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 x layers x kv_heads x head_dim x bytes/elem."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


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
            f"KV bytes per token: {self.bytes_per_token:,}",
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
    """Size the pool: explicit `num_blocks`, else free CUDA memory x utilisation, else the CPU budget."""
    block_bytes = layout.bytes_per_token * block_size
    if num_blocks is not None:
        source = "num_blocks given"
    elif device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        usable = int(free_bytes * gpu_memory_utilization) - activation_reserve_bytes
        num_blocks = usable // block_bytes
        source = f"{gpu_memory_utilization:.0%} of {free_bytes / GB:.2f} GB free after weights"
    else:
        num_blocks = kv_memory_bytes // block_bytes
        source = f"kv_memory_bytes={kv_memory_bytes:,}"
    if num_blocks < 1:
        raise ValueError(f"the KV budget ({source}) holds no block of {block_bytes:,} bytes")
    return MemoryBudget(
        weights_bytes=model_weight_bytes(model), kv_bytes=num_blocks * block_bytes,
        bytes_per_token=layout.bytes_per_token, block_size=block_size, num_blocks=num_blocks,
        max_model_len=max_model_len, source=source)


class KVCachePool:
    """Preallocated K and V blocks of every layer.

    `layer(i)`: [2, num_kv_heads, num_blocks, block_size, head_dim] (K then V), head-major so that
    gathering a batch's blocks yields [2, kv_heads, B, L, head_dim] ready for attention without a
    further copy. Slot `s = block * block_size + offset` holds one token of one sequence.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (layout.num_layers, 2, layout.num_kv_heads, num_blocks, block_size, layout.head_dim)
        self._storage = torch.zeros(shape, dtype=layout.dtype, device=device)

    def layer(self, index: int) -> torch.Tensor:
        return self._storage[index]

    @property
    def num_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()
