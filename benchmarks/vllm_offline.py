"""vLLM's offline engine on a request file: the peer run of benchmarks/engine_throughput.py.

It runs in vLLM's own virtualenv (benchmarks/vllm_env.sh), not kvfleet's, so it imports nothing
from this repository and vLLM only inside main(); engine_throughput starts it as a subprocess:

    $VLLM_VENV/bin/python -m benchmarks.vllm_offline --model DIR --requests IN.json --out OUT.json

IN.json: {"prompts": [[token ids], ...], "max_tokens": [n, ...]}. OUT.json: start-up seconds
(engine built and one token answered), generate seconds, the output token ids of each request,
and, with --decode-streams, the tokens/s of pure decode steps at that many running streams.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model directory (safetensors)")
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--decode-streams", default="0",
                   help="comma-separated stream counts to measure decode at; 0: none")
    p.add_argument("--decode-steps", type=int, default=20)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # its KV cache in GiB on CPU; 1 GiB is what kvfleet's engine gets by default
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # lets its compile cache reload
    from vllm import LLM, SamplingParams

    with open(args.requests) as f:
        spec = json.load(f)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    started = time.perf_counter()
    extra = {}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0, **extra)
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    startup_s = time.perf_counter() - started

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in spec["max_tokens"]]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    result = {"startup_s": startup_s, "seconds": seconds,
              "outputs": [list(o.outputs[0].token_ids) for o in outputs],
              "vllm_version": __import__("vllm").__version__}
    streams = [int(n) for n in args.decode_streams.split(",") if int(n) > 0]
    result["decode_tokens_per_s"] = {n: decode_rate(llm, prompts, n, args.decode_steps,
                                                    SamplingParams) for n in streams}
    if spec.get("prefill_prompts"):
        result["prefill_seconds"] = prefill_seconds(llm, spec["prefill_prompts"], SamplingParams)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


def decode_rate(llm, prompts, streams: int, steps: int, sampling_params_cls) -> float:
    """Output tokens/s at `streams` running sequences: the same streams generating 1 token and
    then 1 + steps tokens; the difference is `steps` decode steps at that batch (prefill and
    the first token cancel out)."""
    batch = (prompts * (streams // len(prompts) + 1))[:streams]

    def timed(max_tokens: int) -> float:
        params = sampling_params_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started

    timed(1)  # warm up: the prefix cache now holds these prompts in both timed runs
    short, long = timed(1), timed(1 + steps)
    return streams * steps / max(long - short, 1e-9)


def prefill_seconds(llm, prompts: list[list[int]], sampling_params_cls) -> float:
    """Seconds to compute these prompts (one token out each); the best of two runs, each after
    its prefix cache is reset, so that every prompt token is computed."""
    params = sampling_params_cls(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(2):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        best = min(best, time.perf_counter() - started)
    return best


if __name__ == "__main__":
    sys.exit(main())
