"""The engine's numerics fingerprint: a short name for everything that decides how it rounds.

Two workers with the same fingerprint compute a stream's next token from the same tokens the
same way, bit for bit, when both are batch-invariant (`--deterministic`, the default): a stream
resumed or handed over between them continues with the text the first would have written. Two
workers with different fingerprints (another CPU kind, another GPU, another product form, dtype,
KV format, attention kernel, tensor-parallel size, kernel build or torch) may not. The fleet
prefers a same-numerics worker for a resume (docs/RELIABILITY.md, "Identical answers").

Every component is decided by the machine's features and the settings, never by a timing, so
every process of one machine kind started with the same settings computes the same fingerprint
whatever the load at start-up. The fingerprint is `fp_` and 10 hex digits of a SHA-256 of the
components (OpenAI's `system_fingerprint` has that shape).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from kvfleet.worker.engine.attention import AttentionBackend
from kvfleet.worker.engine.memory.device import is_cpu, is_cuda
from kvfleet.worker.engine.parallel.tp_group import RankGroup

# CPU flags that decide which code paths compute (the kernels' #if branches, oneDNN's AMX) and
# so how they round; the CPU's model name and other flags do not
ROUNDING_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                  "avx512_fp16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class Numerics:
    components: dict[str, str]  # what decides the rounding, by name

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps(self.components, sort_keys=True).encode())
        return f"fp_{digest.hexdigest()[:10]}"

    def describe(self) -> str:
        """The start-up log's line: the fingerprint and what it stands for."""
        parts = "; ".join(f"{name} {value}" for name, value in sorted(self.components.items()))
        return f"{self.fingerprint} ({parts})"


def engine_numerics(device: torch.device, dtype: torch.dtype, backend: AttentionBackend,
                    kv_format_name: str, block_size: int, model: torch.nn.Module,
                    invariance_gap: str | None, ranks: RankGroup | None) -> Numerics:
    """The fingerprint's components for an engine: device (and on CPU the rounding flags and the
    kernels' build), torch, dtype, KV format, block size, attention kernel, what computes the
    linears, tensor-parallel size, batch invariance (and without it the thread count, which
    oneDNN's and MKL's kernels partition sums by)."""
    import transformers

    components = {
        "device": _device_name(device), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype).removeprefix("torch."), "kv": kv_format_name,
        "block_size": str(block_size), "attention": backend.describe(),
        "linears": ", ".join(sorted(set(linear_kinds(model)))) or "none",
        "tp": str(1 if ranks is None else ranks.world_size),
        "invariant": "yes" if invariance_gap is None else "no",
    }
    if is_cuda(device):  # the Triton kernels (attention, LoRA) compile by its version
        components["triton"] = _triton_version()
    if is_cpu(device):
        from kvfleet.shared.cpu_features import cpu_features
        from kvfleet.worker.engine.kernels import cpu_kernels
        flags = cpu_features().flags
        components["cpu"] = " ".join(f for f in ROUNDING_FLAGS if f in flags) or "none"
        components["kernels"] = cpu_kernels.build_signature()
        if invariance_gap is not None:
            components["threads"] = str(torch.get_num_threads())
    return Numerics(components)


def linear_kinds(module: torch.nn.Module) -> list[str]:
    """What computes each linear of a prepared model, as the fingerprint names it: kvfleet's
    product with its form (its kernel's dtype code and name: float32, bf16 `dot`, `fma`, or
    `amx` on the AMX tiles of cpu_amx.cpp, each summing in its own order), oneDNN's packed
    product, or the module's own class (F.linear, or a tensor-parallel shard of one)."""
    from kvfleet.worker.engine.kernels.cpu_linear import KernelLinear, PackedLinear, SiblingLinear
    from kvfleet.worker.engine.model.model_prep import linear_products

    kinds = []
    for linear in linear_products(module).values():
        computing = linear.group.product if isinstance(linear, SiblingLinear) else linear
        if isinstance(computing, KernelLinear):
            kinds.append(f"kvfleet product {computing.code} ({computing.form})")
        elif isinstance(computing, PackedLinear):
            kinds.append("oneDNN packed")
        else:
            kinds.append(type(computing).__name__)
    return kinds


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def _device_name(device: torch.device) -> str:
    if is_cuda(device):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"cuda {torch.cuda.get_device_name(device)} sm{major}{minor} "
                f"CUDA {torch.version.cuda}")
    return device.type
