"""Offline throughput of kvfleet's engine against HF `generate` and transformers' continuous batching.

The first N requests of a workload (default: ../shared/workloads/chat-mix.jsonl, 64) all arrive
at t=0, each with its own max_tokens and ignore_eos, greedy. Same model, dtype and machine for
every system, in one run. Also: decode throughput at a fixed number of running streams as a
fraction of the matmul roofline measured in the same run, and bf16 beside fp32 with greedy
agreement.

    .venv/bin/python -m benchmarks.engine_throughput                  # the full comparison
    .venv/bin/python -m benchmarks.engine_throughput --num-requests 8 --skip-hf --skip-cb  # quick
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from shared.wire import SamplingParams
from worker.engine.engine import Engine, EngineConfig

# The team's benchmark trace lies beside the repository (`../shared/workloads/`); --workload picks another.
WORKLOAD = str(Path(__file__).resolve().parents[2] / "shared" / "workloads" / "chat-mix.jsonl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    name: str
    output_tokens: int  # useful tokens: each request's own max_tokens
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def load_requests(path: str, num: int, tokenizer) -> list[Request]:
    requests = []
    with open(path) as f:
        for line in f:
            if len(requests) == num:
                break
            item = json.loads(line)
            ids = tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]
            requests.append(Request(list(ids), int(item["max_tokens"])))
    return requests


def load_model(path: str, dtype: torch.dtype, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).eval()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- the systems --------------------------------------------------------------------------------


def run_kvfleet(model, requests: list[Request], config: EngineConfig) -> tuple[Result, list[list[int]], Engine]:
    engine = Engine(copy.deepcopy(model), config)
    start = time.perf_counter()
    outputs = engine.generate([r.prompt for r in requests], [greedy(r.max_tokens) for r in requests])
    seconds = time.perf_counter() - start
    assert [len(o) for o in outputs] == [r.max_tokens for r in requests]
    stats = engine.stats()
    note = (f"preemptions={stats.num_preemptions} prefix hit {stats.prefix_hit_tokens}/"
            f"{stats.prefix_queried_tokens} tokens")
    return Result("kvfleet Engine", sum(map(len, outputs)), seconds, note), outputs, engine


def run_hf_static(model, requests: list[Request], batch_size: int, pad_id: int) -> Result:
    """HF generate in arrival-order static batches, left-padded, each to its longest answer."""
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                                 eos_token_id=None, pad_token_id=pad_id)
        assert out.shape[1] == width + longest
        useful += sum(r.max_tokens for r in batch)
    return Result(f"HF generate, static batch {batch_size}", useful, time.perf_counter() - start,
                  f"{len(requests)} requests")


def run_hf_continuous_batching(model, requests: list[Request]) -> Result:
    """transformers' own continuous batching manager, per-request max_new_tokens, EOS off."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                              eos_token_id=-1, pad_token_id=0)
    useful = 0
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=30) as manager:
        ids = [manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                   eos_token_id=-1) for i, r in enumerate(requests)]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=5)
            if result is None:
                continue
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                if result.error:
                    raise RuntimeError(f"transformers CB failed: {result.error}")
                useful += len(result.generated_tokens)
    return Result("transformers continuous batching", useful, time.perf_counter() - start)


# ---- decode throughput vs roofline --------------------------------------------------------------


def matmul_flops_per_s(dtype: torch.dtype, rows: int, repeats: int = 50) -> float:
    """FLOP/s of a [rows, 576] x [576, 1536] matmul (the model's MLP shape)."""
    x = torch.randn(rows, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=dtype)
    for _ in range(5):
        x @ w.T
    start = time.perf_counter()
    for _ in range(repeats):
        x @ w.T
    return 2 * rows * 576 * 1536 * repeats / (time.perf_counter() - start)


def decode_throughput(model, requests: list[Request], streams: int, steps: int,
                      config: EngineConfig) -> float:
    """Output tokens/s of pure decode steps with `streams` sequences running."""
    engine = Engine(copy.deepcopy(model), config)
    for i, r in enumerate(requests[:streams]):
        engine.add_request(f"d{i}", r.prompt, greedy(steps + 64))
    while engine.stats().num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    start = time.perf_counter()
    produced = sum(len(o.new_token_ids) for _ in range(steps) for o in engine.step())
    return produced / (time.perf_counter() - start)


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests identical, mean fraction of tokens before the first difference)."""
    same, prefix = 0, []
    for a, b in zip(reference, other):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(n / len(a))
    return same / len(reference), statistics.mean(prefix)


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=1, help="kvfleet runs; the median is reported")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true", help="skip HF generate (static batches)")
    p.add_argument("--hf-batch-sizes", default="1,16")
    p.add_argument("--hf-bs1-requests", type=int, default=16,
                   help="requests for the batch-1 HF run (it is slow); 0 = all")
    p.add_argument("--skip-cb", action="store_true", help="skip transformers continuous batching")
    p.add_argument("--decode-streams", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--bf16-requests", type=int, default=8)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    requests = load_requests(args.workload, args.num_requests, tokenizer)
    dtype = DTYPES[args.dtype]
    model = load_model(path, dtype)
    config = EngineConfig(device="cpu", dtype=args.dtype, max_batched_tokens=args.max_batched_tokens,
                          max_running=args.max_running)
    print(f"# {platform.machine()} {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"{args.dtype}, {len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt "
          f"tokens, {sum(r.max_tokens for r in requests)} output tokens; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results: list[Result] = []
    runs = []
    for _ in range(args.repeats):
        result, outputs, engine = run_kvfleet(model, requests, config)
        runs.append(result)
        print(f"  kvfleet run: {result.tokens_per_s:.1f} tok/s ({result.note})", flush=True)
    ours = sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]
    results.append(ours)
    for line in engine.budget_report():
        print(f"  budget: {line}")
    if not args.skip_hf:
        for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
            subset = requests[:args.hf_bs1_requests] if bs == 1 and args.hf_bs1_requests else requests
            results.append(run_hf_static(model, subset, bs, tokenizer.pad_token_id or 0))
            print(f"  {results[-1].name}: {results[-1].tokens_per_s:.1f} tok/s", flush=True)
    if not args.skip_cb:
        results.append(run_hf_continuous_batching(copy.deepcopy(model), requests))
        print(f"  {results[-1].name}: {results[-1].tokens_per_s:.1f} tok/s", flush=True)
    report = {"results": [dict(name=r.name, tokens=r.output_tokens, seconds=r.seconds,
                               tokens_per_s=r.tokens_per_s, note=r.note) for r in results]}
    print("\n| system | output tokens | seconds | output tok/s | kvfleet is |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        ratio = ours.tokens_per_s / r.tokens_per_s
        print(f"| {r.name} | {r.output_tokens} | {r.seconds:.1f} | {r.tokens_per_s:.1f} | {ratio:.2f}x |")
    if not args.skip_decode:
        report["decode"] = decode_section(args, model, requests, config, dtype)
    if not args.skip_bf16 and args.dtype == "float32":
        report["bf16"] = bf16_section(args, model, requests, config)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def decode_section(args, model, requests, config, dtype) -> dict:
    num_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    flops = {rows: matmul_flops_per_s(dtype, rows) for rows in (32, 64, 256)}
    tps = decode_throughput(model, requests, args.decode_streams, args.decode_steps, config)
    peak = flops[args.decode_streams] if args.decode_streams in flops else max(flops.values())
    roofline = peak / (2 * num_params)
    print(f"\ndecode at {args.decode_streams} streams: {tps:.1f} tok/s; matmul "
          + ", ".join(f"{r} rows {f / 1e9:.1f} GFLOP/s" for r, f in flops.items())
          + f"; roofline 2 x {num_params / 1e6:.1f}M params -> {roofline:.1f} tok/s; "
          f"kvfleet reaches {tps / roofline:.0%} of it")
    return {"streams": args.decode_streams, "tokens_per_s": tps, "roofline_tokens_per_s": roofline,
            "matmul_gflops": {r: f / 1e9 for r, f in flops.items()}}


def bf16_section(args, model, requests, config) -> dict:
    subset = requests[:args.bf16_requests]
    fp32_result, fp32_out, _ = run_kvfleet(model, subset, config)
    bf16_config = dataclasses.replace(config, dtype="bfloat16")
    bf16_result, bf16_out, _ = run_kvfleet(model, subset, bf16_config)
    same, prefix = agreement(fp32_out, bf16_out)
    print(f"\nbf16 vs fp32 on {len(subset)} requests: fp32 {fp32_result.tokens_per_s:.1f} tok/s, "
          f"bf16 {bf16_result.tokens_per_s:.1f} tok/s; greedy agreement: {same:.0%} of requests "
          f"identical, {prefix:.0%} of tokens before the first difference")
    return {"requests": len(subset), "fp32_tokens_per_s": fp32_result.tokens_per_s,
            "bf16_tokens_per_s": bf16_result.tokens_per_s, "identical_requests": same,
            "agreeing_prefix": prefix}


if __name__ == "__main__":
    sys.exit(main())
