"""What each KV cache format (`--kv-dtype`) costs in quality, and what it buys in capacity.

Every format runs through kvfleet's engine on the same model (the default, SmolLM2-135M-Instruct,
weights in float32) against the full-precision (fp32) cache as reference, on a fixed corpus of
public-domain English prose and one technical paragraph (benchmarks/data/kv_corpus.txt, one
passage per paragraph):

- greedy agreement: the reference engine generates 256 tokens greedily from each passage's first
  32 tokens; each format then (a) scores that same text teacher-forced, and the agreement is the
  share of the 256 positions where its argmax is the reference's token (what the target counts),
  and (b) generates freely, reported as streams identical over all 256 tokens and the mean length
  of the common prefix (one early flip changes everything after it, so (b) is much noisier);
- mean KL(reference || format) of the next-token distributions, over the greedy texts and over
  the corpus text;
- perplexity of the corpus text (positions 32 .. 287 of each passage) with each format's cache.
Teacher forcing feeds tokens the way serving does (a prefill of 32, then one token per step
reading the cache back), so the quantisation error of every earlier token is in every score.
Capacity: KV bytes per token of this model in each format, and the tokens and 2k-token
conversations a KV budget holds (`--kv-budget`, default 40 GB: the seed's budget), vs bf16.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.kv_quality
    .venv/bin/python -m benchmarks.kv_quality --passages 2 --tokens 32   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.engine_throughput import greedy, load_model
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.shared.byte_size import parse_bytes
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.memory.kv_cache import KVLayout
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
from kvfleet.worker.engine.scoring import teacher_forced_logprobs

CORPUS = Path(__file__).resolve().parent / "data" / "kv_corpus.txt"
REFERENCE = "fp32"


@dataclass
class FormatResult:
    kv_dtype: str
    bytes_per_token: int
    tokens_in_budget: int
    conversations_2k: int
    capacity_vs_bf16: float
    teacher_forced_agreement: float  # share of positions whose argmax is the reference token
    free_run_identical: int  # streams identical to the reference over every generated token
    free_run_common_prefix: float  # mean tokens before the first difference
    kl_greedy: float  # mean KL(reference || format) on the reference's greedy texts
    kl_corpus: float  # the same on the corpus text
    perplexity: float  # of the corpus text


def kl(reference: torch.Tensor, tested: torch.Tensor) -> torch.Tensor:
    """KL(reference || tested) per row of log-probs [B, vocab] -> [B]."""
    return torch.sum(reference.exp() * (reference - tested), dim=-1)


def make_engine(model, kv_dtype: str, num_blocks: int) -> Engine:
    config = EngineConfig(device="cpu", dtype="float32", kv_dtype=kv_dtype, num_blocks=num_blocks,
                          block_size=16, max_batched_tokens=4096, enable_prefix_caching=False)
    return Engine(model, config)  # engines share the model; each has its own pool


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def score_all(engines: dict[str, Engine], sequences: list[list[int]], context: int,
              num_greedy: int) -> dict[str, dict[str, float]]:
    """Teacher-force `sequences` through every engine in lockstep; rows [0, num_greedy) are the
    reference's greedy texts, the rest corpus text."""
    streams = {name: teacher_forced_logprobs(e, sequences, context) for name, e in engines.items()}
    sums = {name: {"agree": 0.0, "kl_greedy": 0.0, "kl_corpus": 0.0, "nll": 0.0} for name in engines}
    positions = 0
    for steps in zip(*streams.values()):
        position = steps[0][0]
        logprobs = {name: lp for name, (_, lp) in zip(streams, steps)}
        nxt = torch.tensor([s[position + 1] for s in sequences])
        ref = logprobs[REFERENCE]
        for name, lp in logprobs.items():
            divergence = kl(ref, lp)
            sums[name]["agree"] += (lp[:num_greedy].argmax(-1) == nxt[:num_greedy]).float().sum().item()
            sums[name]["kl_greedy"] += divergence[:num_greedy].sum().item()
            sums[name]["kl_corpus"] += divergence[num_greedy:].sum().item()
            sums[name]["nll"] -= lp[num_greedy:].gather(1, nxt[num_greedy:, None]).sum().item()
        positions += 1
    num_corpus = len(sequences) - num_greedy
    return {name: {"agreement": s["agree"] / (positions * num_greedy),
                   "kl_greedy": s["kl_greedy"] / (positions * num_greedy),
                   "kl_corpus": s["kl_corpus"] / (positions * num_corpus),
                   "perplexity": float(torch.tensor(s["nll"] / (positions * num_corpus)).exp())}
            for name, s in sums.items()}


def capacity(model_config, kv_dtype: str, budget_bytes: int) -> tuple[int, int]:
    layout = KVLayout.from_model_config(model_config, resolve_kv_format(kv_dtype, torch.float32))
    return layout.bytes_per_token, budget_bytes // layout.bytes_per_token


def run(args) -> list[FormatResult]:
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, torch.float32)
    passages = [p.strip() for p in args.corpus.read_text().split("\n\n") if p.strip()][:args.passages]
    texts = [tokenizer(p)["input_ids"] for p in passages]
    length = args.context + args.tokens
    if min(map(len, texts)) < length:
        raise SystemExit(f"every passage needs >= {length} tokens")
    texts = [t[:length] for t in texts]
    prompts = [t[:args.context] for t in texts]
    formats = [REFERENCE] + [f for f in args.formats if f != REFERENCE]
    num_blocks = 2 * len(texts) * (-(-length // 16)) + 8
    engines = {f: make_engine(model, f, num_blocks) for f in formats}

    started = time.perf_counter()
    generated = {f: e.generate(prompts, greedy(args.tokens)) for f, e in engines.items()}
    print(f"greedy generation: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    reference_texts = [p + g for p, g in zip(prompts, generated[REFERENCE])]
    started = time.perf_counter()
    scores = score_all(engines, reference_texts + texts, args.context, len(reference_texts))
    print(f"teacher-forced scoring: {time.perf_counter() - started:.0f} s", file=sys.stderr)

    budget = parse_bytes(args.kv_budget)
    _, bf16_tokens = capacity(model.config, "bf16", budget)
    results = []
    for name in formats:
        per_token, tokens = capacity(model.config, name, budget)
        prefixes = [common_prefix(g, r) for g, r in zip(generated[name], generated[REFERENCE])]
        results.append(FormatResult(
            kv_dtype=name, bytes_per_token=per_token, tokens_in_budget=tokens,
            conversations_2k=tokens // 2048, capacity_vs_bf16=tokens / bf16_tokens,
            teacher_forced_agreement=scores[name]["agreement"],
            free_run_identical=sum(p == args.tokens for p in prefixes),
            free_run_common_prefix=sum(prefixes) / len(prefixes),
            kl_greedy=scores[name]["kl_greedy"], kl_corpus=scores[name]["kl_corpus"],
            perplexity=scores[name]["perplexity"]))
    return results


def print_table(results: list[FormatResult], args) -> None:
    print(f"model {args.model} (float32 weights), {args.passages} passages, prompt {args.context} "
          f"tokens, {args.tokens} scored/generated; capacity in {args.kv_budget} of KV")
    print(f"{'kv':>5} {'B/token':>8} {'tokens':>12} {'2k conv':>8} {'vs bf16':>8} {'agree':>7} "
          f"{'identical':>9} {'prefix':>7} {'KL greedy':>10} {'KL corpus':>10} {'ppl':>7}")
    for r in results:
        print(f"{r.kv_dtype:>5} {r.bytes_per_token:>8,} {r.tokens_in_budget:>12,} "
              f"{r.conversations_2k:>8,} {r.capacity_vs_bf16:>7.2f}x {r.teacher_forced_agreement:>7.2%} "
              f"{r.free_run_identical:>4}/{args.passages:<4} {r.free_run_common_prefix:>7.1f} "
              f"{r.kl_greedy:>10.2e} {r.kl_corpus:>10.2e} {r.perplexity:>7.3f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--formats", type=lambda s: s.split(","), default=["bf16", "fp16", "fp8", "int8"],
                   help="formats compared with fp32, comma-separated (default: bf16,fp16,fp8,int8)")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="passages separated by blank lines")
    p.add_argument("--passages", type=int, default=8)
    p.add_argument("--context", type=int, default=32, help="prompt tokens per passage")
    p.add_argument("--tokens", type=int, default=256, help="tokens generated and scored per passage")
    p.add_argument("--kv-budget", default="40GB", help="KV bytes for the capacity columns")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = run(args)
    print_table(results, args)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
