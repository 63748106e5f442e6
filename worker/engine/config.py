"""The engine's configuration: pool size and format, batching limits, caching switch, preemption
policy, device, dtype, attention backend and CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.cuda_graphs import CUDA_GRAPH_MODES
from worker.engine.attention import ATTENTION_BACKENDS
from worker.engine.kv_format import KV_DTYPE_CHOICES
from worker.engine.preemption import PREEMPTION_MODES


@dataclass
class EngineConfig:
    # tokens per KV block; None = auto: 64 for a bf16 pool read by the C++ CPU attention kernel,
    # else 16 (device.resolve_block_size)
    block_size: int | None = None
    num_blocks: int | None = None  # explicit pool size (tests); else from the memory budget
    kv_memory_bytes: int = 1 << 30  # KV budget on CPU
    gpu_memory_utilization: float = 0.9  # fraction of free device memory (after weights) for KV
    max_batched_tokens: int = 512  # tokens computed per step: decodes first, then prefill chunks
    max_running: int = 64  # streams in the running group at most
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of blocks kept free when admitting new work
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: bf16 on CUDA and on CPUs with native bf16 (AMX, AVX512-BF16), else float32
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_dtype: str = "auto"  # KV pool format: auto (= dtype) | bf16 | fp16 | fp32 | fp8 | int8
    preemption: str = "auto"  # auto | swap | recompute
    swap_space_bytes: int = 4 << 30  # host memory for swapped-out KV blocks
    attention_backend: str = "auto"  # auto (triton on CUDA, the C++ kernel on CPU, else sdpa) | sdpa | cpu | triton
    cuda_graphs: str = "auto"  # auto (decode graphs with the triton backend on CUDA) | off | eager
    grammar_cache_size: int = 256  # compiled output constraints kept (LRU)
    # ranks (one process and device each) the model is split over; budgets above are per rank
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_batched_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batched_tokens and max_running must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, got {self.kv_dtype!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPH_MODES)}, "
                             f"got {self.cuda_graphs!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
