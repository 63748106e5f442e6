"""kvfleet's paged decode attention (cpu_attention.cpp) at git revisions, timed side by side in
one process on this machine: one decode step's attention over every layer of a model shape.

    .venv/bin/python -m benchmarks.attention_revisions --revisions HEAD~1 HEAD --context 600

Each revision's cpu_attention.cpp (with its headers) is built as the engine builds its kernels
(kernel_build.py: the same flags, -march=native) and bound from that revision's header. A step
is `--streams` decoding sequences whose contexts are spread evenly over [context / 2, 3 context /
2], each sequence's pages at seeded random places of the pool (as a pool that has served a while
holds them), one pool per layer (`--layers`; together they outgrow the last-level cache, so the
keys and values come from memory as in an engine's step). Every revision's outputs must equal
the first's bit for bit (each row's sum order is the kernel's contract: the prefill row form
repeats it), then the revisions are timed in alternated rounds; the table gives each one's
fastest and median step and the keys and values read over its fastest step's time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.amx_revisions import kernel_at
from kvfleet.worker.engine.kernels.cpu_attention import DTYPE_CODES
from kvfleet.worker.engine.memory.device import CPU_BF16_BLOCK_SIZE, DEFAULT_BLOCK_SIZE

FILES = ("cpu_attention.cpp", "cpu_attention.h", "cpu_kernels.h")
# rows per pool page: the CPU's bf16 pools' and its float32 pools' (the engine's defaults)
BLOCK_SIZES = {torch.bfloat16: CPU_BF16_BLOCK_SIZE, torch.float32: DEFAULT_BLOCK_SIZE}


def parse_shape(text: str) -> tuple[int, int, int]:
    """"9x3x64" -> (9, 3, 64): query heads, KV heads, head dim."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not HEADSxKV_HEADSxHEAD_DIM")
    heads, kv_heads, dim = (int(p) for p in parts)
    if heads % kv_heads:
        raise argparse.ArgumentTypeError(f"{heads} query heads do not share {kv_heads} KV heads")
    return heads, kv_heads, dim


class Step:
    """A decode step's inputs for every layer: pools, block tables, contexts and queries."""

    def __init__(self, shape: tuple[int, int, int], streams: int, context: int, layers: int,
                 dtype: torch.dtype, seed: int = 0):
        heads, kv_heads, dim = shape
        self.block_size = bs = BLOCK_SIZES[dtype]
        generator = torch.Generator().manual_seed(seed)
        lo, hi = max(1, context // 2), max(1, context * 3 // 2)
        self.ctx = torch.tensor([lo + (hi - lo) * i // max(1, streams - 1) for i in range(streams)],
                                dtype=torch.int32)
        pages = [-(-int(c) // bs) for c in self.ctx]
        self.num_blocks = sum(pages) + 8
        self.width = max(pages)
        order = torch.randperm(self.num_blocks, generator=generator).to(torch.int32)
        self.tables = torch.zeros(streams, self.width, dtype=torch.int32)
        start = 0
        for s, n in enumerate(pages):
            self.tables[s, :n] = order[start:start + n]
            start += n
        self.pools = [torch.randn(2, kv_heads, self.num_blocks, bs, dim,
                                  generator=generator).to(dtype) for _ in range(layers)]
        self.queries = [torch.randn(heads, streams, dim, generator=generator).to(dtype)
                        for _ in range(layers)]
        self.outs = [torch.empty(streams, heads, dim, dtype=dtype) for _ in range(layers)]
        self.shape, self.streams, self.dtype = shape, streams, dtype
        self.bytes = int(self.ctx.sum()) * kv_heads * dim * 2 * dtype.itemsize * layers

    def run(self, kernel, threads: int) -> list[torch.Tensor]:
        """One step's attention with `kernel`: every layer's, in order."""
        heads, kv_heads, dim = self.shape
        for q, pool, out in zip(self.queries, self.pools, self.outs):
            status = kernel.kvfleet_paged_decode(
                DTYPE_CODES[self.dtype], q.data_ptr(), q.stride(0), q.stride(1), pool.data_ptr(),
                out.data_ptr(), self.tables.data_ptr(), self.width, self.ctx.data_ptr(),
                self.streams, heads, kv_heads, dim, self.num_blocks, self.block_size, dim ** -0.5,
                threads)
            assert status == 0, status
        return self.outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revisions", nargs="+", default=["HEAD"])
    parser.add_argument("--shape", type=parse_shape, default=(9, 3, 64),
                        help="HEADSxKV_HEADSxHEAD_DIM (default: the default model's 9x3x64; the "
                             "1B shape's 32x8x64)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--context", type=int, default=600,
                        help="the contexts' mean (spread over [mean / 2, 3 mean / 2])")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--unchecked", action="store_true",
                        help="time revisions whose results differ (an experiment that leaves a "
                             "part out), without the bit check")
    args = parser.parse_args()
    if min(args.layers, args.streams, args.context, args.rounds) < 1:
        parser.error("--layers, --streams, --context and --rounds must be positive")
    threads = torch.get_num_threads()
    step = Step(args.shape, args.streams, args.context, args.layers, getattr(torch, args.dtype))
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {rev: kernel_at(rev, Path(scratch), FILES) for rev in args.revisions}
        first = [out.clone() for out in step.run(kernels[args.revisions[0]], threads)]
        for rev in args.revisions[1:] if not args.unchecked else ():
            for layer, out in enumerate(step.run(kernels[rev], threads)):
                if not torch.equal(out, first[layer]):
                    raise SystemExit(f"{rev} computes other bits than {args.revisions[0]} "
                                     f"(layer {layer})")
        times: dict[str, list[float]] = {rev: [] for rev in args.revisions}
        for _ in range(args.rounds):
            for rev, kernel in kernels.items():
                start = time.perf_counter()
                step.run(kernel, threads)
                times[rev].append(time.perf_counter() - start)
    heads, kv_heads, dim = args.shape
    print(f"# {threads} threads, {args.dtype}, {heads} heads / {kv_heads} KV heads of {dim}, "
          f"{args.layers} layers, {args.streams} streams, contexts {int(step.ctx.min())}-"
          f"{int(step.ctx.max())} (sum {int(step.ctx.sum())}); {args.rounds} alternated "
          f"rounds; " + ("outputs not compared" if args.unchecked else
                           "outputs equal bit for bit across revisions"))
    print("| revision | fastest step (ms) | median step (ms) | K/V read (GB/s, fastest) | "
          f"median / {args.revisions[0]}'s |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(times[args.revisions[0]])
    for rev, ts in times.items():
        print(f"| {rev} | {min(ts) * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} | "
              f"{step.bytes / min(ts) / 1e9:.1f} | {statistics.median(ts) / base:.3f} |")


if __name__ == "__main__":
    main()
