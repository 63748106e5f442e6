"""Per-step overhead of tensor parallelism on the CPU, and the share of it spent communicating.

One random Llama-style model (seeded; 16 heads, 8 KV heads so both ranks get equal shards),
`--streams` greedy streams: their prefill steps, then `--decode-steps` steps where every stream
decodes. Measured for
  - TP=1 with 1 thread,
  - TP=1 with 2 threads (one process on the cores TP=2 uses),
  - TP=2: 2 gloo ranks (rank 0 this process, rank 1 a child), 1 thread each,
with the median step time of each phase and, for TP=2, rank 0's time in the layers' all_reduces
and in the step broadcasts as a share of the step (an all_reduce also waits for the slower rank).
The greedy tokens of every configuration are compared.

    .venv/bin/python -m benchmarks.tensor_parallel                 # the recorded run
    .venv/bin/python -m benchmarks.tensor_parallel --layers 2 --decode-steps 5   # quick
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.process.tp_rank import launch_engine


def build_model(layers: int, hidden: int) -> LlamaForCausalLM:
    """The same seeded weights in every process (the ranks' loader)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                         vocab_size=32000, max_position_embeddings=4096, initializer_range=0.1)
    return LlamaForCausalLM(config)


def run_config(args, tp: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    loader = functools.partial(build_model, args.layers, args.hidden)
    config = EngineConfig(device="cpu", dtype="float32", block_size=16,
                          kv_memory_bytes=512 << 20, max_batched_tokens=args.prefill_tokens,
                          max_running=args.streams, enable_prefix_caching=False,
                          tensor_parallel_size=tp)
    engine = launch_engine(loader, config, num_threads=threads)
    try:
        g = torch.Generator().manual_seed(1)
        params = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0.0, ignore_eos=True)
        for i in range(args.streams):
            prompt = torch.randint(3, 32000, (args.prompt_len,), generator=g).tolist()
            engine.add_request(f"s{i}", prompt, params)
        produced: dict[str, list[int]] = {}
        prefill_s = step_until(engine, produced, lambda: len(produced) < args.streams)
        engine.step()  # first all-decode step: warm-up, not timed
        timers = _timers(engine)
        decode_s: list[float] = []
        step_until(engine, produced, lambda: len(decode_s) < args.decode_steps, decode_s)
        all_reduce_s, broadcast_s = (a - b for a, b in zip(_timers(engine), timers))
        while engine.has_unfinished():
            _collect(engine.step(), produced)
        return {
            "tp": tp, "threads_per_rank": threads,
            "prefill_step_ms": 1000 * statistics.median(prefill_s),
            "decode_step_ms": 1000 * statistics.median(decode_s),
            "all_reduce_share": all_reduce_s / sum(decode_s) if tp > 1 else 0.0,
            "broadcast_share": broadcast_s / sum(decode_s) if tp > 1 else 0.0,
            "tokens": [produced[f"s{i}"] for i in range(args.streams)],
        }
    finally:
        engine.close()


def step_until(engine: Engine, produced: dict, condition, times: list[float] | None = None):
    times = [] if times is None else times
    while condition():
        started = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - started)
        _collect(outputs, produced)
    return times


def _collect(outputs, produced: dict) -> None:
    for out in outputs:
        if out.new_token_ids:
            produced.setdefault(out.req_id, []).extend(out.new_token_ids)


def _timers(engine: Engine) -> tuple[float, float]:
    if engine.ranks is None:
        return 0.0, 0.0
    return engine.ranks.comm_timer.seconds, engine.ranks.message_timer.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512, help="max_batched_tokens")
    parser.add_argument("--decode-steps", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = [run_config(args, 1, 1), run_config(args, 1, 2), run_config(args, 2, 1)]
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    tp1, tp2 = results[1], results[2]
    summary = {
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "model": f"random Llama, {args.layers} layers, hidden {args.hidden}, 16 heads / 8 KV",
        "streams": args.streams, "prompt_len": args.prompt_len,
        "decode_overhead_tp2_vs_tp1_2threads": tp2["decode_step_ms"] / tp1["decode_step_ms"],
        "prefill_overhead_tp2_vs_tp1_2threads": tp2["prefill_step_ms"] / tp1["prefill_step_ms"],
        "greedy_tokens_identical": same,
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['model']}; {args.streams} streams x {args.prompt_len}-token prompts")
    print(f"{'config':<22}{'prefill step ms':>16}{'decode step ms':>16}{'all_reduce':>12}"
          f"{'broadcast':>11}")
    for r in summary["runs"]:
        name = f"TP={r['tp']} x {r['threads_per_rank']} thread(s)"
        print(f"{name:<22}{r['prefill_step_ms']:>16.1f}{r['decode_step_ms']:>16.1f}"
              f"{r['all_reduce_share']:>12.1%}{r['broadcast_share']:>11.1%}")
    print(f"TP=2 / TP=1 (2 threads): decode step x{summary['decode_overhead_tp2_vs_tp1_2threads']:.2f},"
          f" prefill step x{summary['prefill_overhead_tp2_vs_tp1_2threads']:.2f}; "
          f"greedy tokens identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
