"""The accelerators a simulated worker can stand for, by name, with their published ceilings.

Each `Accelerator` holds what its vendor's datasheet says (memory, dense BF16 tensor FLOP/s without
sparsity, memory bandwidth, the device-to-device link a tensor-parallel worker's all-reduces
cross, the host link that KV swapping crosses) and what a serving engine gets of them: the
efficiencies are fractions of those peaks that well-tuned engines reach on these parts, estimates
rather than measurements (a measured curve, worker/sim/cost.py's `MeasuredCost`, replaces the
whole roofline where one exists):

- prefill runs large matrix products: about 60 % of the tensor peak;
- decode runs skinny products (a few rows against every weight): about 35 % of it, which only
  binds at large batches (a small batch's decode is bound by reading the weights);
- memory reads stream at about 80 % of the datasheet bandwidth;
- a step costs a few milliseconds on top (kernel launches the CUDA graphs do not cover, sampling,
  the host-device synchronisation at its end). The scheduler's own time is not in it: in a
  simulated worker the scheduler runs for real.

Link bandwidths are per direction: NVIDIA quotes NVLink and PCIe as the sum of both directions
(H100's "900 GB/s NVLink" is 450 GB/s each way), and a ring all-reduce sends and receives at once.
Memory sizes are the datasheet's GB read as GiB (HBM stacks come in binary sizes: an H100's
80 GB is 81,559 MiB as nvidia-smi reports it, less what the driver keeps); the part the engine may
use is a fraction of it (cost.py's `memory_utilization`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Accelerator:
    """One device's ceilings and the fractions of them a serving engine reaches."""

    name: str
    memory_bytes: int  # device memory
    peak_bf16_flops: float  # dense BF16 tensor FLOP/s (no 2:4 sparsity)
    memory_bandwidth: float  # device memory bytes/s
    link_bandwidth: float  # bytes/s per direction between two devices of one worker (TP)
    link_latency_s: float  # one collective's fixed cost (launch, synchronisation, first hop)
    host_link_bandwidth: float  # bytes/s per direction to host memory (KV swap and offload)
    prefill_efficiency: float = 0.6  # fraction of peak FLOP/s in prefill's large products
    decode_efficiency: float = 0.35  # fraction of peak FLOP/s in decode's skinny products
    memory_efficiency: float = 0.8  # fraction of memory bandwidth a step's reads stream at
    step_overhead_s: float = 0.002  # launches, sampling and the sync ending each step
    link: str = "NVLink"  # what the devices of a tensor-parallel worker talk over

    def describe(self) -> str:
        return (f"{self.name} ({self.memory_bytes / GIB:.0f} GiB, "
                f"{self.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, "
                f"{self.memory_bandwidth / 1e12:.2f} TB/s, {self.link} "
                f"{self.link_bandwidth / 1e9:.0f} GB/s)")


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 80 GB HBM3, 3.35 TB/s, BF16 tensor
    # 1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s, PCIe Gen5 128 GB/s (NVLink and
    # PCIe as both directions summed, here too)
    "h100": Accelerator("h100", memory_bytes=80 * GIB, peak_bf16_flops=989e12,
                        memory_bandwidth=3.35e12, link_bandwidth=450e9, link_latency_s=10e-6,
                        host_link_bandwidth=64e9),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: 141 GB HBM3e, 4.8 TB/s, BF16 tensor
    # 1,979 TFLOPS with sparsity (989 dense: H100's chip), NVLink 900 GB/s, PCIe Gen5 128 GB/s
    "h200": Accelerator("h200", memory_bytes=141 * GIB, peak_bf16_flops=989e12,
                        memory_bandwidth=4.8e12, link_bandwidth=450e9, link_latency_s=10e-6,
                        host_link_bandwidth=64e9),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: HBM2e 2,039 GB/s, BF16 tensor
    # 312 TFLOPS (624 with sparsity), NVLink 600 GB/s, PCIe Gen4 64 GB/s
    "a100": Accelerator("a100", memory_bytes=80 * GIB, peak_bf16_flops=312e12,
                        memory_bandwidth=2.039e12, link_bandwidth=300e9, link_latency_s=10e-6,
                        host_link_bandwidth=32e9),
    # NVIDIA L40S datasheet: 48 GB GDDR6 with ECC, 864 GB/s, BF16 tensor 362.05 TFLOPS (733 with
    # sparsity), PCIe Gen4 x16 64 GB/s, no NVLink: tensor parallelism crosses PCIe, with a
    # longer latency per collective
    "l40s": Accelerator("l40s", memory_bytes=48 * GIB, peak_bf16_flops=362e12,
                        memory_bandwidth=0.864e12, link_bandwidth=32e9, link_latency_s=25e-6,
                        host_link_bandwidth=32e9, link="PCIe"),
}

ALIASES: dict[str, str] = {
    "h100-sxm": "h100", "h100-sxm5": "h100", "h100-80gb": "h100", "h100-sxm-80gb": "h100",
    "h200-sxm": "h200", "h200-141gb": "h200",
    "a100-sxm": "a100", "a100-80gb": "a100", "a100-sxm-80gb": "a100", "a100-sxm4-80gb": "a100",
    "l40s-48gb": "l40s",
}


def accelerator(name: str) -> Accelerator:
    """The accelerator called `name` (case-insensitive, aliases such as "h100-sxm" or
    "a100-80gb" too); ValueError naming the known ones for any other name."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)} "
                         f"(aliases: {', '.join(ALIASES)})")
    return ACCELERATORS[key]
