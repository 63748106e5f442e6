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
the first, and the weight's bytes over each form's time. Needs a CPU with AMX-BF16 tiles (the
script says so and exits 1 elsewhere).

`--shapes 512x2048x16384,16x2048x16384` times other shapes (rows x in x out). With `--weights
16` each shape has 16 distinct weights and every call takes the next: an engine's layers' weights
outgrow the last-level cache, so each call reads its weight from memory, as a step does (with
one weight, every call after the first finds it cached; this machine's last-level cache can
hold hundreds of MiB):

    .venv/bin/python -m benchmarks.amx_revisions --revisions 8ed0482 HEAD --weights 16 \
        --calls 16 --shapes 512x2048x16384,512x8192x2048
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
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


def kernel_at(revision: str, directory: Path, files: tuple[str, ...] = FILES) -> BoundKernel:
    """files[0] (a kernel's source; files[1] its interface, the rest headers it includes) of
    `revision`, built as the engine builds it and bound."""
    folder = directory / revision.replace("/", "_")
    folder.mkdir()
    for name in files:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:{KERNELS}/{name}"],
                              check=True, capture_output=True).stdout
        (folder / name).write_bytes(text)
    library = build(folder / files[0], tuple(folder / n for n in files[1:]),
                    compiler=cpu_kernels.compiler_name(), cache_dir=folder)
    return BoundKernel(ctypes.CDLL(str(library)), read_header(folder / files[1]))


def product(kernel: BoundKernel, weights: list[torch.Tensor], x: torch.Tensor, threads: int):
    """A call computing x W^T with `kernel` over its packing of each of `weights` in turn (the
    first call the first weight's, the next the next's, cycling)."""
    n, k = weights[0].shape
    packs = []
    for weight in weights:
        packed = torch.empty(-(-n // 16) * 16 * -(-k // 32) * 32, dtype=torch.bfloat16)
        assert kernel.kvfleet_amx_pack(AMX, weight.data_ptr(), n, k, packed.data_ptr(),
                                       threads) == 0
        packs.append(packed)
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    turn = itertools.cycle(packs)

    def call() -> torch.Tensor:
        status = kernel.kvfleet_amx_linear(AMX, x.data_ptr(), x.shape[0], k, k,
                                           next(turn).data_ptr(), n, None, y.data_ptr(), n,
                                           threads)
        assert status == 0, status
        return y
    return call


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """"16x2048x8192,32x576x960" -> ((16, 2048, 8192), (32, 576, 960))."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{item!r} is not ROWSxINxOUT (positive integers)")
        shapes.append(tuple(int(p) for p in parts))
    return tuple(shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revisions", nargs="+", default=["HEAD"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                        help="ROWSxINxOUT,... (default: the prefill and MLP shapes above); "
                             "e.g. 16x2048x16384 for a decode step of 16 streams at the 1B "
                             "model's gate/up")
    parser.add_argument("--weights", type=int, default=1,
                        help="distinct weights per shape, each call the next one's (as an "
                             "engine's layers take theirs): with enough that they outgrow the "
                             "last-level cache, every call reads its weight from memory")
    args = parser.parse_args()
    if args.weights < 1:
        parser.error("--weights must be at least 1")
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {rev: kernel_at(rev, Path(scratch)) for rev in args.revisions}
        if any(k.kvfleet_amx_supported(AMX) != 1 for k in kernels.values()):
            print("this CPU has no AMX-BF16 tiles (or Linux refused their state)")
            sys.exit(1)
        generator = torch.Generator().manual_seed(0)
        names = [*args.revisions, "oneDNN"]
        print(f"# {threads} threads; GFLOP/s of each form's fastest of {args.rounds} alternated "
              f"rounds of {args.calls} calls; outputs equal bit for bit across revisions; "
              f"the weight streamed: its bf16 bytes over each form's time (a decode-sized "
              f"product reads its weight from memory once a call)")
        print("| [rows, in] x [in, out] | " + " | ".join(names) + " | "
              + " | ".join(f"{r} / {args.revisions[0]}" for r in args.revisions[1:])
              + " | weight streamed, GB/s (" + ", ".join(names) + ") |")
        print("|---|" + "---:|" * (len(names) + len(args.revisions)))
        for m, k, n in args.shapes:
            weights = [torch.randn(n, k, generator=generator).to(torch.bfloat16)
                       for _ in range(args.weights)]
            x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
            calls = {rev: product(kern, weights, x, threads) for rev, kern in kernels.items()}
            first = calls[args.revisions[0]]().clone()
            for rev, call in list(calls.items())[1:]:
                if not torch.equal(call(), first):
                    raise SystemExit(f"{rev} computes other bits than {args.revisions[0]} at "
                                     f"[{m}, {k}] x [{k}, {n}]")
            onednn = []
            for weight in weights:
                linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
                with torch.no_grad():
                    linear.weight.copy_(weight)
                onednn.append(PackedLinear(linear))
            onednn_turn = itertools.cycle(onednn)
            calls["oneDNN"] = lambda: next(onednn_turn)(x)
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
                                       for r in args.revisions[1:])
                  + " | " + ", ".join(f"{2 * k * n / best[x] / 1e9:.1f}" for x in names) + " |")


if __name__ == "__main__":
    main()
