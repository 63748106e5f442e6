"""What constrained decoding costs: engine throughput on the same trace with every request free,
and with half of them (every other one) constrained by a JSON schema, in one run.

The first N requests of the trace (default: benchmarks/data/chat-mix-64.jsonl, 64) arrive at
t=0 with their own max_tokens, sampled at temperature 1 with a seed each. A constrained request
follows a schema whose shortest answer is longer than any max_tokens of the trace (an array of
many short strings), so it ends at its max_tokens like the free ones (ignore_eos): both runs
produce the same number of tokens, and the throughput ratio is the cost of computing one token
mask per constrained request per step and applying it in the sampler. Runs alternate
(free, mixed, free, mixed, ...) so a noisy neighbour hits both; medians are reported.

    .venv/bin/python -m benchmarks.constrained_decoding
    .venv/bin/python -m benchmarks.constrained_decoding --num-requests 16 --rounds 1  # quick
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from kvfleet.shared.wire import SamplingParams
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from benchmarks.engine_throughput import load_requests
from kvfleet.shared.structured import OutputConstraint
from kvfleet.worker.engine.engine import Engine, EngineConfig

WORKLOAD = str(Path(__file__).resolve().parent / "data" / "chat-mix-64.jsonl")
# Longer than any answer the trace allows: 400 strings of up to 8 characters.
LONG_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
               "properties": {"items": {"type": "array", "minItems": 400, "maxItems": 400,
                                        "items": {"type": "string", "maxLength": 8}}}}


def params_for(i: int, max_tokens: int, constrained: bool) -> SamplingParams:
    if constrained:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i,
                              constraint=OutputConstraint.json_schema(LONG_SCHEMA))
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)


def run(engine: Engine, requests, constrained_every: int, tag: str) -> tuple[int, float]:
    """(output tokens, seconds) for all requests at once; request i is constrained when
    constrained_every > 0 and i % constrained_every == 0."""
    for i, request in enumerate(requests):
        constrained = constrained_every > 0 and i % constrained_every == 0
        engine.add_request(f"{tag}-{i}", request.prompt,
                           params_for(i, request.max_tokens, constrained))
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finish_reason not in (None, "length"):
                raise AssertionError(f"{out.req_id} ended with {out.finish_reason}")
    return tokens, time.perf_counter() - start


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default=WORKLOAD)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds after round 0")
    parser.add_argument("--kv-memory-gib", type=float, default=2.0)
    args = parser.parse_args()

    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    requests = load_requests(args.workload, args.num_requests, tokenizer)
    engine = Engine.from_pretrained(path, EngineConfig(
        device="cpu", dtype="float32", kv_memory_bytes=int(args.kv_memory_gib * 2**30),
        max_running=args.num_requests), tokenizer=tokenizer)
    print(f"model {DEFAULT_MODEL}, {len(requests)} requests of {args.workload}, "
          f"{sum(r.max_tokens for r in requests)} output tokens per run; CPU: {cpu_name()}, "
          f"torch threads {torch.get_num_threads()}")
    compile_start = time.perf_counter()
    engine.constrained.compiler.matcher(OutputConstraint.json_schema(LONG_SCHEMA))
    print(f"grammar: tokenizer view + first compile {time.perf_counter() - compile_start:.2f} s "
          f"(once per worker; later requests hit the cache)")
    run(engine, requests[:4], 2, "warmup")
    rates: dict[str, list[float]] = {"free": [], "mixed": []}
    # Round 0 fills the prefix cache with the trace's prompts (its free run prefills them, its
    # mixed run hits the cache): it is printed but left out of the medians.
    for r in range(args.rounds + 1):
        for name, every in (("free", 0), ("mixed", 2)):
            tokens, seconds = run(engine, requests, every, f"{name}{r}")
            if r > 0:
                rates[name].append(tokens / seconds)
            print(f"round {r} {name:5s}: {tokens} tokens in {seconds:.2f} s = "
                  f"{tokens / seconds:.1f} tok/s" + (" (cache warm-up)" if r == 0 else ""))
    free, mixed = statistics.median(rates["free"]), statistics.median(rates["mixed"])
    print(f"median free {free:.1f} tok/s, 50/50 mixed {mixed:.1f} tok/s: "
          f"mixed/free = {mixed / free:.3f} (cost {100 * (1 - mixed / free):.1f}%)")


if __name__ == "__main__":
    main()
