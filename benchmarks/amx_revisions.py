"""kvfleet's bf16 product on AMX tiles (cpu_amx.cpp) at two git revisions, and oneDNN's packed
product (what vLLM's CPU build runs), timed side by side in one process on this machine.

    .venv/bin/python -m benchmarks.amx_revisions --revisions 8ed0482 HEAD

Each revision's cpu_amx.cpp (with its headers) is compiled as the engine compiles its kernels
(kernel_build.py: the same flags, -march=native) into a temporary folder and bound from that
revision's header. Every shape ([rows, in] x [in, out]: the 135M default model's prefill
products and the Llama-3.2-1B MLP's) takes seeded random bf16 operands; each revision's output
must equal the first's bit for bit (the sum order is the kernel's contract), then the forms are
timed in alternated rounds (--rounds, --calls each) and the table gives GFLOP/s from each one's
fastest round (on a shared host the fastest is the least disturbed) and each revision's ratio to
the first. Needs a CPU with AMX-BF16 tiles (the script says so and exits 1 elsewhere).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvfleet.worker.engine.kernels import cpu_kernels
from kvfleet.worker.engine.kernels.cpu_linear import BF16_FORM_CODES, PackedLinear
from kvfleet.worker.engine.kernels.kernel_binding import BoundKernel, read_header
from kvfleet.worker.engine.kernels.kernel_build import build

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "worker/engine/kernels"
FILES = ("cpu_amx.cpp", "cpu_amx.h", "cpu_kernels.h")
SHAPES = ((2048, 576, 960), (2048, 576, 576), (2048, 576, 3072), (2048, 1536, 576),
          (512, 576, 3072), (512, 2048, 8192), (512, 8192, 2048), (32, 2048, 8192))
AMX = BF16_FORM_CODES["amx"]


def kernel_at(revision: str, directory: Path) -> BoundKernel:
    """cpu_amx.cpp of `revision`, built and bound."""
    folder = directory / revision.replace("/", "_")
    folder.mkdir()
    for name in FILES:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{KERNELS}/{name}"],
                              check=True, capture_output=True).stdout
        (folder / name).write_bytes(text)
    library = build(folder / FILES[0], tuple(folder / n for n in FILES[1:]),
                    compiler=cpu_kernels.compiler_name(), cache_dir=folder)
    return BoundKernel(ctypes.CDLL(str(library)), read_header(folder / FILES[1]))


def product(kernel: BoundKernel, weight: torch.Tensor, x: torch.Tensor, threads: int):
    """A call computing x W^T with `kernel` over its packing of `weight`."""
    n, k = weight.shape
    packed = torch.empty(-(-n // 16) * 16 * -(-k // 32) * 32, dtype=torch.bfloat16)
    assert kernel.kvfleet_amx_pack(AMX, weight.data_ptr(), n, k, packed.data_ptr(), threads) == 0
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)

    def call() -> torch.Tensor:
        status = kernel.kvfleet_amx_linear(AMX, x.data_ptr(), x.shape[0], k, k, packed.data_ptr(),
                                           n, None, y.data_ptr(), n, threads)
        assert status == 0, status
        return y
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revisions", nargs="+", default=["HEAD"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {rev: kernel_at(rev, Path(scratch)) for rev in args.revisions}
        if any(k.kvfleet_amx_supported(AMX) != 1 for k in kernels.values()):
            print("this CPU has no AMX-BF16 tiles (or Linux refused their state)")
            sys.exit(1)
        generator = torch.Generator().manual_seed(0)
        names = [*args.revisions, "oneDNN"]
        print(f"# {threads} threads; GFLOP/s of each form's fastest of {args.rounds} alternated "
              f"rounds of {args.calls} calls; outputs equal bit for bit across revisions")
        print("| [rows, in] x [in, out] | " + " | ".join(names) + " | "
              + " | ".join(f"{r} / {args.revisions[0]}" for r in args.revisions[1:]) + " |")
        print("|---|" + "---:|" * (len(names) + len(args.revisions) - 1))
        for m, k, n in SHAPES:
            weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            calls = {rev: product(kern, weight, x, threads) for rev, kern in kernels.items()}
            first = calls[args.revisions[0]]().clone()
            for rev, call in calls.items():
                if not torch.equal(call(), first):
                    raise SystemExit(f"{rev} computes other bits than {args.revisions[0]} at "
                                     f"[{m}, {k}] x [{k}, {n}]")
            linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                linear.weight.copy_(weight)
            onednn = PackedLinear(linear)
            calls["oneDNN"] = lambda: onednn(x)
            best = dict.fromkeys(names, float("inf"))
            for _ in range(args.rounds):
                for name in names:
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        calls[name]()
                    best[name] = min(best[name], (time.perf_counter() - start) / args.calls)
            rate = {name: 2 * m * k * n / best[name] / 1e9 for name in names}
            print(f"| [{m}, {k}] x [{k}, {n}] | " + " | ".join(f"{rate[x]:,.0f}" for x in names)
                  + " | " + " | ".join(f"{rate[r] / rate[args.revisions[0]]:.2f}x"
                                       for r in args.revisions[1:]) + " |")


if __name__ == "__main__":
    main()
