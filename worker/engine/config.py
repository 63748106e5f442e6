"""The engine's configuration: pool size, batching limits, caching switch, device and dtype."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # explicit pool size (tests); else from the memory budget
    kv_memory_bytes: int = 1 << 30  # KV budget on CPU
    gpu_memory_utilization: float = 0.9  # fraction of free device memory (after weights) for KV
    max_batched_tokens: int = 512  # tokens computed per step: decodes first, then prefill chunks
    max_running: int = 64  # streams in the running group at most
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of blocks kept free when admitting new work
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_batched_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batched_tokens and max_running must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
