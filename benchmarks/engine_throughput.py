"""Offline throughput of kvfleet's engine beside vLLM, HF `generate` and transformers' continuous
batching.

The first N requests of a workload (default: benchmarks/data/chat-mix-64.jsonl, 64) all arrive
at t=0, each with its own max_tokens and ignore_eos, greedy. Same model and machine for every
system, in one run: kvfleet and vLLM at each of --dtypes (bf16 and float32 by default; the one
`--dtype auto` picks on this CPU is marked), HF and transformers CB at --hf-dtype. Also: start-up
to the first token of both engines, greedy agreement between dtypes, and both engines against
this CPU's ceilings measured in the same run (benchmarks/roofline.py): prefill of random prompts
in FLOP/s over the peak product rate (bf16 and float32, at the model's largest linear: the best
of every implementation this machine has, kvfleet's or a library's, named), decode
at 1 and 32 running streams over the memory roofline (every weight and every stream's K/V read
once per step at the measured read bandwidth). `--model random:llama-3.2-1b` (-3b,
qwen2.5-1.5b, qwen3-moe-30b-a3b-8l32e) runs a real model's shape with random weights, the same
in both engines (shared/model_shapes.py); outputs are nonsense, lengths fixed (ignore_eos).
The CPU's model and ISA head the output, with the OpenMP wait settings every in-process system
runs under (`kvfleet up` gives its workers OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000; set the
same here to measure what it serves: OMP_WAIT_POLICY=PASSIVE alone sleeps torch's threads after
every parallel region and doubles kvfleet's decode steps). vLLM runs in its own virtualenv
(benchmarks/vllm_env.sh; without one its rows are skipped with a message), as a subprocess that
gets none of these variables, nor any other OpenMP or allocator variable of this shell
(benchmarks/peer_env.py): its CPU guide's setup alone.

`--repeats N`: at each dtype, every system runs once per round, in the same order, N rounds
(kvfleet, vLLM, HF static batches, transformers CB at HF's dtype; kvfleet, vLLM, ...), each vLLM
run a process of its own with its start-up. The table gives medians over the rounds and the
ratios of the medians; with N > 1 also each round's tok/s, and each round's ratio of kvfleet at
the row's dtype (the run it alternated with) to the row, with their median. HF at a dtype none
of --dtypes names runs its N rounds after the others. The start-up section is measured once;
the roofline section's prefill and decode figures once a round for each engine (kvfleet's right
after its run, vLLM's inside its run), the medians printed with every round's figure. The rounds
and the table: benchmarks/engine_rounds.py.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \\
      .venv/bin/python -m benchmarks.engine_throughput                # the full comparison
    .venv/bin/python -m benchmarks.engine_throughput --num-requests 8 --skip-hf --skip-cb  # quick
    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.engine_throughput \
      --model random:llama-3.2-1b --num-requests 32 --skip-hf --skip-cb --dtypes auto
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.shared.wire import SamplingParams
from benchmarks.engine_prefill import prefill_prompts, prefill_seconds
from benchmarks.engine_rounds import Result, System, alternate, combine, print_table, rounds_note
from benchmarks.peer_env import dropped_line
from benchmarks.roofline import ModelCost, product_rates, read_bandwidth
from benchmarks.vllm_peer import SETUP_HINT, SETUPS, describe_setup, run_offline, vllm_python
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.memory.device import resolve_dtype

# The benchmark trace ships with the repository (the first 64 requests of the chat-mix trace, the
# default --num-requests); --workload picks another.
WORKLOAD = str(Path(__file__).resolve().parent / "data" / "chat-mix-64.jsonl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def openmp_wait() -> str:
    """The libgomp wait settings of this process (read when torch loaded it)."""
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    return " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ) or "libgomp defaults"


def load_requests(path: str, num: int, tokenizer, raw: bool = False) -> list[Request]:
    """The first `num` requests: each prompt in the model's chat template as one user message,
    or with `raw` the text alone, tokenised as /v1/completions does (what benchmarks/http_peers.py
    and `kvfleet bench --endpoint completions` send)."""
    requests = []
    with open(path) as f:
        for line in f:
            if len(requests) == num:
                break
            item = json.loads(line)
            if raw:
                ids = tokenizer.encode(item["prompt"])
            else:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                    add_generation_prompt=True,
                                                    tokenize=True)["input_ids"]
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


def decode_throughput(model, requests: list[Request], streams: int, steps: int,
                      config: EngineConfig) -> tuple[float, float]:
    """Output tokens/s of pure decode steps with `streams` sequences running (the requests'
    prompts, repeated where there are fewer, as vLLM's offline run repeats them), and their mean
    context length over those steps."""
    engine = Engine(copy.deepcopy(model), config)
    for i, r in enumerate((requests * (streams // len(requests) + 1))[:streams]):
        engine.add_request(f"d{i}", r.prompt, greedy(steps + 64))
    while engine.stats().num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    contexts = [s.num_tokens for s in engine.scheduler.running]
    start = time.perf_counter()
    produced = sum(len(o.new_token_ids) for _ in range(steps) for o in engine.step())
    return produced / (time.perf_counter() - start), sum(contexts) / len(contexts) + steps / 2


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
    p.add_argument("--raw-prompts", action="store_true",
                   help="prompts as plain text, as the HTTP comparison sends them to "
                        "/v1/completions (default: each in the chat template)")
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="kvfleet and vLLM run at each (auto = what --dtype auto picks here)")
    p.add_argument("--hf-dtype", default="auto", help="dtype of HF generate and transformers CB")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds: at each dtype every system (kvfleet, vLLM, HF, transformers CB) "
                        "runs once per round, alternated; medians and each round's ratio")
    p.add_argument("--attention-backends", default="auto",
                   help="kvfleet runs at each dtype, one per backend (e.g. auto,sdpa: the CPU "
                        "decode kernel beside gather + SDPA)")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true", help="skip HF generate (static batches)")
    p.add_argument("--hf-batch-sizes", default="1,16")
    p.add_argument("--hf-bs1-requests", type=int, default=16,
                   help="requests for the batch-1 HF run (it is slow); 0 = all")
    p.add_argument("--skip-cb", action="store_true", help="skip transformers continuous batching")
    p.add_argument("--skip-vllm", action="store_true", help="skip vLLM (benchmarks/vllm_env.sh)")
    p.add_argument("--vllm-venv", default=None, help="vLLM's virtualenv (default: vllm_env.sh's)")
    p.add_argument("--vllm-setups", default="tuned",
                   help="vLLM runs at each dtype, one per setup: tuned (its CPU guide's: every "
                        "core, tcmalloc + Intel OpenMP; its fastest here) and/or defaults")
    p.add_argument("--decode-streams", default="1,32",
                   help="comma-separated running streams to measure decode at")
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--prefill-prompts", type=int, default=4,
                   help="random prompts whose prefill is timed against the peak (0: none)")
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--skip-roofline", action="store_true",
                   help="no prefill/decode measurement against the CPU's ceilings")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def resolve_name(name: str) -> str:
    """'auto' -> the dtype name `--dtype auto` resolves to on this machine's CPU."""
    return {v: k for k, v in DTYPES.items()}[resolve_dtype(name, torch.device("cpu"))]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    requests = load_requests(args.workload, args.num_requests, tokenizer, args.raw_prompts)
    auto = resolve_name("auto")
    dtypes = list(dict.fromkeys(resolve_name(d) for d in args.dtypes.split(",")))
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    vllm = None if args.skip_vllm else vllm_python(args.vllm_venv)
    print(f"# CPU {cpu_features().describe()}; {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}; --dtype auto = {auto}; {len(requests)} requests "
          f"({'raw prompts' if args.raw_prompts else 'prompts in the chat template'}), "
          f"{sum(len(r.prompt) for r in requests)} prompt tokens, "
          f"{sum(r.max_tokens for r in requests)} output tokens; OpenMP wait: {openmp_wait()}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if vllm is not None and (dropped := dropped_line(peers="vLLM")):
        print(dropped, flush=True)
    if vllm is None and not args.skip_vllm:
        print(f"# vLLM skipped: no virtualenv with vllm found; {SETUP_HINT}", flush=True)
    setups = [s for s in args.vllm_setups.split(",") if s]
    if unknown := set(setups) - set(SETUPS):
        raise SystemExit(f"--vllm-setups: unknown {sorted(unknown)}; choose from {SETUPS}")
    for setup in setups if vllm else ():
        print(f"# vLLM setup {setup}: {describe_setup(vllm, setup)}", flush=True)
    outputs: dict[str, list[list[int]]] = {}  # each system's answers in its first round
    startups: dict[str, float] = {}
    vllm_runs: dict[str, list] = {}  # dtype -> vLLM's offline runs with the measurements
    kvfleet_runs: dict[str, list[dict]] = {}  # dtype -> kvfleet's measurements, one per round
    hf_name = resolve_name(args.hf_dtype)
    hf_systems = not (args.skip_hf and args.skip_cb)
    rows: list[Result] = []
    for name in dtypes:
        # every system of this dtype once per round, in this order: kvfleet (each attention
        # backend), vLLM (each setup), HF and transformers CB where they run at this dtype
        systems: list[System] = []
        reference = f"kvfleet {name}"
        for i, backend in enumerate(args.attention_backends.split(",")):
            label = f"{name}{' = auto' if name == auto else ''}"
            key = f"kvfleet {name}"
            if i > 0:  # the first backend's run is the dtype's row; others are named after theirs
                label, key = f"{name}, attention {backend}", f"kvfleet {name} attention {backend}"
            config = engine_config(args, name, backend)
            model, startups[key] = kvfleet_start(path, requests, config)
            measure = None
            if name == auto and not args.skip_roofline and i == 0:
                # the roofline section's measurements, once a round beside vLLM's
                measure = functools.partial(kvfleet_extras, args, load_model(path, DTYPES[name]),
                                            requests, config)
            systems.append(System(key, kvfleet_runner(
                model, requests, config, label, key, outputs, measure,
                kvfleet_runs.setdefault(name, [])), reference))
        for j, setup in enumerate(setups if vllm is not None else ()):
            label = name if len(setups) == 1 else f"{name}, {setup}"
            systems.append(System(f"vLLM {label}", vllm_runner(
                args, vllm, path, requests, name, setup, label,
                # the roofline measurements at auto's dtype share the first setup's first run
                measured=name == auto and not args.skip_roofline and j == 0,
                outputs=outputs, startups=startups, vllm_runs=vllm_runs), reference))
        if hf_systems and name == hf_name:
            systems += hf_runners(args, load_model(path, DTYPES[hf_name]), requests, tokenizer,
                                  hf_name, reference)
            hf_systems = False  # they alternate with this dtype's runs
        print(f"# {name}: {len(systems)} systems, {args.repeats} round(s) each, alternated",
              flush=True)
        rows += combine(systems, alternate(systems, args.repeats))
        del systems
    if hf_systems:  # HF's dtype is none of --dtypes: no kvfleet run to alternate with
        systems = hf_runners(args, load_model(path, DTYPES[hf_name]), requests, tokenizer,
                             hf_name, None)
        print(f"# {hf_name} (HF alone: not among --dtypes): {args.repeats} round(s) each",
              flush=True)
        rows += combine(systems, alternate(systems, args.repeats))
    results = rows
    report = {"cpu": cpu_features().describe(), "auto_dtype": auto, "openmp_wait": openmp_wait(),
              "results": [dataclasses.asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
              "startup_s": startups}
    print_table(results, auto)
    report["agreement"] = agreement_section(outputs)
    print("\nstart-up to the first token (engine built from the model directory, one token out): "
          + ", ".join(f"{k} {v:.1f} s" for k, v in startups.items()))
    if not args.skip_roofline:
        report["roofline"] = roofline_section(args, path, requests, auto,
                                              vllm_runs.get(auto, []), kvfleet_runs.get(auto, []))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def engine_config(args, dtype: str, attention_backend: str = "auto") -> EngineConfig:
    return EngineConfig(device="cpu", dtype=dtype, max_batched_tokens=args.max_batched_tokens,
                        max_running=args.max_running, attention_backend=attention_backend)


def kvfleet_start(path: str, requests: list[Request],
                  config: EngineConfig) -> tuple[torch.nn.Module, float]:
    """kvfleet's model as the engine loads it, and the start-up time of building the engine
    from the model directory and answering one token (what vLLM's start-up is timed as)."""
    started = time.perf_counter()
    engine = Engine.from_pretrained(path, config)
    engine.generate([requests[0].prompt], greedy(1))
    return engine.model, time.perf_counter() - started


def kvfleet_runner(model, requests: list[Request], config: EngineConfig, label: str, key: str,
                   outputs: dict, measure: Callable[[], dict] | None = None,
                   measured: list[dict] | None = None) -> Callable[[int], Result]:
    """kvfleet's run of a round; with `measure`, then the roofline section's measurements of
    the round (kvfleet_extras), appended to `measured`."""
    def run(round_index: int) -> Result:
        result, answers, _ = run_kvfleet(model, requests, config)
        result.name = f"kvfleet, {label}"
        outputs.setdefault(key, answers)
        print(f"  {result.name}: {result.tokens_per_s:.1f} tok/s ({result.note})", flush=True)
        if measure is not None:
            measured.append(measure())
        return result
    return run


def kvfleet_extras(args, model, requests: list[Request], config: EngineConfig) -> dict:
    """One round's decode rates at each --decode-streams (with their mean contexts) and prefill
    time of the --prefill-prompts, each on a fresh engine over `model`."""
    out: dict = {"decode": {}, "context": {}, "prefill_seconds": None}
    for streams in decode_streams(args):
        out["decode"][streams], out["context"][streams] = decode_throughput(
            model, requests, streams, args.decode_steps, config)
    if args.prefill_prompts:
        out["prefill_seconds"] = prefill_seconds(model, prefill_prompts(args), config)
    return out


def vllm_runner(args, vllm: Path, path: str, requests: list[Request], dtype: str, setup: str,
                label: str, measured: bool, outputs: dict, startups: dict,
                vllm_runs: dict) -> Callable[[int], Result]:
    """vLLM's offline run (a process of its own each round, its start-up timed each time); with
    `measured`, the decode and prefill measurements of the roofline section in every round's,
    appended to `vllm_runs[dtype]` (as kvfleet's are, each round: kvfleet_runner)."""
    key, startup_s = f"vLLM {label}", []

    def run(round_index: int) -> Result:
        done = run_offline(vllm, path, [r.prompt for r in requests],
                           [r.max_tokens for r in requests], dtype, args.max_running,
                           tuple(decode_streams(args)) if measured else (), setup=setup,
                           prefill_prompts=prefill_prompts(args) if measured else None)
        if measured:
            vllm_runs.setdefault(dtype, []).append(done)
        outputs.setdefault(key, done.outputs)
        startup_s.append(done.startup_s)
        startups[key] = statistics.median(startup_s)
        result = Result(f"vLLM {done.version}, {label}", sum(map(len, done.outputs)),
                        done.seconds, f"start-up {done.startup_s:.0f} s")
        print(f"  {result.name}: {result.tokens_per_s:.1f} tok/s ({result.note})", flush=True)
        return result
    return run


def hf_runners(args, model, requests: list[Request], tokenizer, hf_name: str,
               reference: str | None) -> list[System]:
    """HF generate at each static batch size and transformers' continuous batching, in this
    process (as kvfleet's engine runs), each a system of the rounds."""
    systems = []

    def named(result: Result) -> Result:
        result.name += f", {hf_name}"
        print(f"  {result.name}: {result.tokens_per_s:.1f} tok/s", flush=True)
        return result

    for bs in ([] if args.skip_hf else [int(b) for b in args.hf_batch_sizes.split(",")]):
        subset = requests[:args.hf_bs1_requests] if bs == 1 and args.hf_bs1_requests else requests
        systems.append(System(f"HF static {bs}", lambda _, subset=subset, bs=bs: named(
            run_hf_static(model, subset, bs, tokenizer.pad_token_id or 0)), reference))
    if not args.skip_cb:
        systems.append(System("transformers CB", lambda _: named(
            run_hf_continuous_batching(copy.deepcopy(model), requests)), reference))
    return systems


def agreement_section(outputs: dict[str, list[list[int]]]) -> dict:
    """Greedy agreement of each run with kvfleet float32 (and of vLLM with kvfleet at its dtype)."""
    pairs = [(k, "kvfleet float32") for k in outputs if k != "kvfleet float32"]
    pairs += [(k, k.replace("vLLM", "kvfleet")) for k in outputs
              if k.startswith("vLLM") and k != "vLLM float32"]
    report = {}
    for tested, reference in pairs:
        if reference in outputs and tested != reference:
            same, prefix = agreement(outputs[reference], outputs[tested])
            report[f"{tested} vs {reference}"] = {"identical": same, "agreeing_prefix": prefix}
            print(f"greedy agreement, {tested} vs {reference}: {same:.0%} of requests identical, "
                  f"{prefix:.0%} of tokens before the first difference")
    return report


def roofline_section(args, path: str, requests: list[Request], dtype: str,
                     vllm_runs: list, kvfleet_runs: list[dict]) -> dict:
    """kvfleet's prefill and decode against this CPU's ceilings (and vLLM's, from its offline
    runs at the same dtype, prompts and streams): the medians of the rounds' measurements, each
    side measured once a round, alternated with the other (kvfleet_runs, vllm_runs); without
    rounds' measurements, kvfleet's measured now.

    Prefill: prompt FLOPs per second (benchmarks/roofline.py's count) over the peak product rate
    measured at the model's largest linear shape, bf16 and float32: the best of every product
    implementation this machine has (roofline.product_rates: kvfleet's forms, oneDNN's, MKL's,
    torch's), each one's rate and the one that set the peak printed and reported. Decode at each of
    --decode-streams: tokens/s over the memory roofline, the step's floor of reading every weight
    and every stream's K/V once at the read bandwidth measured on a buffer of that size."""
    model = load_model(path, DTYPES[dtype])
    cost = ModelCost.of(model)
    cfg = model.config
    shape = (cfg.hidden_size, cost.q_width if cost.num_experts > 1 else cfg.intermediate_size)
    peaks = {name: product_rates(t, *shape) for name, t in DTYPES.items()}
    print("\npeak product rate, the best of every implementation here:\n" + "\n".join(
        f"  {rates.describe()}" for rates in peaks.values()))
    report: dict = {"dtype": dtype, "isa": cpu_features().isa,
                    "peak_gflops": {n: r.peak / 1e9 for n, r in peaks.items()},
                    "peak_by": {n: r.peak_by for n, r in peaks.items()},
                    "products_gflops": {n: {k: v / 1e9 for k, v in r.as_dict().items()}
                                        for n, r in peaks.items()},
                    "engine_products": {n: r.engine for n, r in peaks.items()},
                    "products_skipped": {n: r.skipped for n, r in peaks.items() if r.skipped}}
    config = engine_config(args, dtype)
    peak, peak_by = peaks[dtype].peak, peaks[dtype].peak_by
    ours_runs = kvfleet_runs or [kvfleet_extras(args, model, requests, config)]
    if args.prefill_prompts:
        prompts = prefill_prompts(args)
        flops = cost.prefill_flops([len(p) for p in prompts])
        tokens = sum(map(len, prompts))
        seconds = [r["prefill_seconds"] for r in ours_runs]
        ours = statistics.median(seconds)
        report["prefill"] = {"prompts": len(prompts), "tokens": tokens, "flops": flops,
                             "kvfleet_tokens_per_s": tokens / ours,
                             "kvfleet_of_peak": flops / ours / peak,
                             "kvfleet_rounds_tokens_per_s": [tokens / t for t in seconds]}
        print(f"prefill of {len(prompts)} x {args.prefill_len} tokens, {dtype}: kvfleet "
              f"{tokens / ours:.0f} tok/s = {flops / ours / 1e9:.0f} GFLOP/s, "
              f"{flops / ours / peak:.0%} of the peak ({peak / 1e9:.0f}, {peak_by})"
              f"{rounds_note([tokens / t for t in seconds], '.0f')}")
        theirs_s = [r.prefill_seconds for r in vllm_runs if r.prefill_seconds]
        if theirs_s:
            theirs = statistics.median(theirs_s)
            report["prefill"] |= {"vllm_tokens_per_s": tokens / theirs,
                                  "vllm_of_peak": flops / theirs / peak,
                                  "vllm_rounds_tokens_per_s": [tokens / t for t in theirs_s]}
            print(f"prefill, vLLM: {tokens / theirs:.0f} tok/s, {flops / theirs / peak:.0%} of "
                  f"the peak{rounds_note([tokens / t for t in theirs_s], '.0f')}; kvfleet is "
                  f"{theirs / ours:.2f}x")
    report["decode"] = []
    elem = DTYPES[dtype].itemsize
    for streams in decode_streams(args):
        rates = [r["decode"][streams] for r in ours_runs]
        tps, context = statistics.median(rates), ours_runs[0]["context"][streams]
        need = cost.decode_step_bytes(streams, context, elem)
        bandwidth = read_bandwidth(int(need["total"]))
        memory_roofline = streams * bandwidth / need["total"]
        floor = max(need["total"] / bandwidth, cost.decode_step_flops(streams) / peak)
        row = {"streams": streams, "mean_context": context, "kvfleet_tokens_per_s": tps,
               "step_bytes": need, "read_gb_per_s": bandwidth / 1e9,
               "memory_roofline_tokens_per_s": memory_roofline,
               "roofline_tokens_per_s": streams / floor,
               "kvfleet_of_memory_roofline": tps / memory_roofline,
               "kvfleet_rounds_tokens_per_s": rates}
        print(f"decode at {streams} streams (mean context {context:.0f}), {dtype}: kvfleet "
              f"{tps:.1f} tok/s{rounds_note(rates, '.1f')}; a step reads {need['total'] / 1e6:.0f} MB (weights "
              f"{need['weights'] / 1e6:.0f}, K/V {need['kv'] / 1e6:.0f}) at {bandwidth / 1e9:.1f} "
              f"GB/s: memory roofline {memory_roofline:.1f} tok/s, kvfleet at "
              f"{tps / memory_roofline:.0%}; with the products at the peak rate: "
              f"{streams / floor:.1f} tok/s, kvfleet at {tps * floor / streams:.0%}")
        theirs_rates = [r.decode_tokens_per_s[streams] for r in vllm_runs
                        if r.decode_tokens_per_s.get(streams)]
        if theirs_rates:
            theirs = statistics.median(theirs_rates)
            row |= {"vllm_tokens_per_s": theirs, "vllm_rounds_tokens_per_s": theirs_rates}
            print(f"  vLLM {theirs:.1f} tok/s{rounds_note(theirs_rates, '.1f')} "
                  f"({theirs / memory_roofline:.0%} of the memory roofline); kvfleet is "
                  f"{tps / theirs:.2f}x")
        report["decode"].append(row)
    return report


def decode_streams(args) -> list[int]:
    return [] if args.skip_decode else [int(n) for n in args.decode_streams.split(",")]


if __name__ == "__main__":
    sys.exit(main())
