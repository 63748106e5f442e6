"""LoRA adapters over HTTP (issue 37): the throughput of 32 streams spread over 4 adapters against
the base model alone, kvfleet beside vLLM's CPU build (`--enable-lora`) and transformers + peft's
own mixed-adapter `generate`; and how long an adapter registered at run time takes to serve its
first request on a worker that never held it.

    .venv/bin/python -m benchmarks.lora                       # 1 round, every peer
    .venv/bin/python -m benchmarks.lora --rounds 3 --skip-peft
    .venv/bin/python -m benchmarks.lora --num-requests 8 --skip-vllm --skip-peft   # a quick try

Adapters: `--adapters` (4) random rank-`--rank` (16) PEFT adapters of the default model on
q/k/v/o and gate/up/down, made here with peft (A ~ N(0, 1/in), B ~ N(0, `--b-std`²), lora_alpha =
2r) and saved with its `save_pretrained` into `--adapter-dir` (kept: the same seed gives the
same adapters). Their answers mean nothing; the trace asks for fixed lengths (ignore_eos).

Trace: the first `--num-requests` (32) requests of benchmarks/data/chat-mix-64.jsonl, raw prompts
to /v1/completions, greedy, each its own max_tokens with ignore_eos, all sent at once (closed
loop of `--streams` 32); request i names adapter i mod 4 (the base model in the base runs).
Systems, each on a server of its own, started here, timed to its first answer, warmed up:
- kvfleet base: `kvfleet up` (one worker, default dtype), no LoRA;
- kvfleet LoRA: the same with `--enable-lora --max-loras 4 --max-lora-rank R` and the adapters
  named with `--lora-modules` (one worker: every step mixes the 4 adapters);
- vLLM base and vLLM LoRA: its OpenAI server (benchmarks/vllm_env.sh; tuned as its CPU guide
  says), the same flags in its spelling; skipped with a message when its virtualenv is missing
  or its LoRA server does not start;
- peft: transformers + peft in this process, the same 32 prompts in one left-padded batch with
  `adapter_names` (peft's mixed-adapter batch), greedy, `--peft-tokens` new tokens each.
Registration: on the kvfleet LoRA server after its runs, a fifth adapter is registered with
`POST /v1/load_lora_adapter` and a one-token request names it at once: seconds from the
registration's send to that request's first token (target: 2 s), three adapters in turn.

`--rounds N` runs every server, then peft's generate, once per round in the same order; the
tables give medians and each ratio is the median over the rounds of that round's ratio
(benchmarks/http_peers.py says why). Any failed request fails the run (exit 1, after the
report). The servers get none of this shell's OpenMP or allocator variables
(benchmarks/peer_env.py); peft runs in this process, under them. Time: kvfleet servers start in
~20 s, vLLM's in ~2 min on a 2-core host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.http_peers import WORKLOAD, free_port, stop_session, wait_first_answer
from benchmarks.peer_env import dropped_line, peer_env
from benchmarks.vllm_peer import REPO, SETUP_HINT, VllmServer, describe_setup, vllm_python
from kvfleet.bench.client import BenchTarget
from kvfleet.bench.loadgen import LoadSpec, replay
from kvfleet.bench.trace import TraceRequest, load_trace
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path

ADAPTER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REGISTRATION_TARGET_S = 2.0


@dataclass(frozen=True)
class System:
    name: str
    vllm: bool = False
    lora: bool = False


@dataclass
class Run:
    system: str
    round_index: int
    requests: int
    ok: int
    output_tokens: int
    duration_s: float
    tokens_per_s: float
    error: str | None


# ---------------------------------------------------------------- adapters and trace


def make_adapters(model_dir: str, out_dir: Path, count: int, rank: int, b_std: float,
                  seed: int = 0) -> dict[str, str]:
    """`count` random PEFT adapters of the model (made once per seed and rank); name -> dir."""
    names = {f"adapter-{i}": out_dir / f"r{rank}-s{seed + i}" for i in range(count)}
    missing = [d for d in names.values() if not (d / "adapter_model.safetensors").exists()]
    if missing:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for index, directory in enumerate(names.values()):
            if directory in missing:
                config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ADAPTER_TARGETS)
                peft_model = get_peft_model(base, config)
                generator = torch.Generator().manual_seed(seed + index)
                for name, param in peft_model.named_parameters():
                    if "lora_A" in name:
                        param.data = torch.randn(param.shape, generator=generator) / math.sqrt(
                            param.shape[1])
                    elif "lora_B" in name:
                        param.data = torch.randn(param.shape, generator=generator) * b_std
                peft_model.save_pretrained(str(directory))
                base = peft_model.unload()  # the base model back, without LoRA layers
    return {name: str(directory) for name, directory in names.items()}


def spread(requests: list[TraceRequest], names: list[str] | None) -> list[TraceRequest]:
    """Request i names adapter i mod len(names) (None: the base model)."""
    if not names:
        return requests
    return [TraceRequest(r.arrival_s, r.prompt, r.max_tokens, r.ignore_eos,
                         model=names[i % len(names)]) for i, r in enumerate(requests)]


async def _replay(url: str, requests: list[TraceRequest], streams: int, timeout_s: float):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(streams, 20))
    target = BenchTarget(DEFAULT_MODEL, "completions", timeout_s, 0.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as client:
        return await replay(client, target, requests,
                            LoadSpec(rate=math.inf, concurrency=streams))


def measure(system: System, round_index: int, url: str, requests: list[TraceRequest],
            streams: int, timeout_s: float) -> Run:
    result = asyncio.run(_replay(url, requests, streams, timeout_s))
    tokens = sum(r.output_tokens or 0 for r in result.records if r.ok)
    return Run(system.name, round_index, len(result.records),
               sum(r.ok for r in result.records), tokens, result.duration_s,
               tokens / max(result.duration_s, 1e-9),
               next((r.error for r in result.records if r.error), None))


# ---------------------------------------------------------------- the servers


def kvfleet_up(port: int, adapters: dict[str, str] | None, rank: int,
               log_path: Path) -> subprocess.Popen:
    """`kvfleet up` with one worker; LoRA on with the adapters named at start-up when given."""
    command = [sys.executable, "-m", "kvfleet", "up", "--port", str(port), "--workers", "1"]
    env = peer_env({"KVFLEET_EMBEDDED_REDIS_PORT": str(free_port()),
                    "KVFLEET_MAX_QUEUE_WAIT_S": "0"})
    if adapters is not None:
        command += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
        env.update(KVFLEET_ENABLE_LORA="true", KVFLEET_MAX_LORAS="4",
                   KVFLEET_MAX_LORA_RANK=str(rank))
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def vllm_lora_args(adapters: dict[str, str], rank: int) -> tuple[str, ...]:
    return ("--enable-lora", "--max-loras", "4", "--max-lora-rank", str(rank),
            "--max-cpu-loras", str(max(4, len(adapters))), "--lora-modules",
            *(f"{n}={p}" for n, p in adapters.items()))


@contextlib.contextmanager
def serving(system: System, args, vllm: Path | None, adapters: dict[str, str],
            log_path: Path) -> Iterator[str]:
    port = free_port()
    started = time.perf_counter()
    if system.vllm:
        extra = vllm_lora_args(adapters, args.rank) if system.lora else ()
        server = VllmServer(vllm, resolve_model_path(DEFAULT_MODEL), port, args.vllm_dtype,
                            log_path, served_name=DEFAULT_MODEL, extra_args=extra)
        process, url, stop = server.process, server.url, server.stop
    else:
        process = kvfleet_up(port, adapters if system.lora else None, args.rank, log_path)
        url, stop = f"http://127.0.0.1:{port}", lambda: stop_session(process)
    try:
        wait_first_answer(url, DEFAULT_MODEL, process, args.startup_timeout_s)
        print(f"  {system.name}: first answer {time.perf_counter() - started:.1f} s after start",
              flush=True)
        warm = [TraceRequest(0.0, "Say hello.", 8, model=name)
                for name in (list(adapters) if system.lora else [None])]
        asyncio.run(_replay(url, warm, len(warm), args.timeout_s))
        yield url
    finally:
        stop()


def registration_s(url: str, name: str, path: str, timeout_s: float) -> float:
    """Seconds from sending the registration of adapter `name` to the first token of a request
    that names it."""
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/load_lora_adapter", timeout=timeout_s,
                       json={"lora_name": name, "lora_path": path})
    reply.raise_for_status()
    body = {"model": name, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError(f"no token for {name}")


def run_server(system: System, round_index: int, args, vllm: Path | None,
               adapters: dict[str, str], fresh: dict[str, str], requests: list[TraceRequest],
               log_dir: Path) -> tuple[Run, list[float]]:
    tag = f"{system.name.lower().replace(' ', '-')}-{round_index + 1}"
    with serving(system, args, vllm, adapters, log_dir / f"{tag}.log") as url:
        run = measure(system, round_index, url, spread(requests, list(adapters)
                                                        if system.lora else None),
                      args.streams, args.timeout_s)
        print(f"  {system.name}: {run.ok}/{run.requests} ok, {run.output_tokens} tokens in "
              f"{run.duration_s:.1f} s = {run.tokens_per_s:.1f} tok/s"
              + (f" (error: {run.error})" if run.error else ""), flush=True)
        registrations = []
        if system.lora and not system.vllm:
            for name, path in fresh.items():
                registrations.append(registration_s(url, f"{name}-r{round_index}", path,
                                                    args.timeout_s))
            print("  registration to first token: "
                  + ", ".join(f"{s:.2f} s" for s in registrations), flush=True)
    return run, registrations


# ---------------------------------------------------------------- peft


def peft_tokens_per_s(model_dir: str, adapters: dict[str, str], requests: list[TraceRequest],
                      new_tokens: int, dtype_name: str) -> float:
    """transformers + peft: one left-padded batch, request i under adapter i mod 4 (peft's
    `adapter_names`), greedy, exactly `new_tokens` each; output tokens per second."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    names = list(adapters)
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    batch = tokenizer([r.prompt for r in requests], return_tensors="pt", padding=True)
    adapter_names = [names[i % len(names)] for i in range(len(requests))]
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(**batch, adapter_names=adapter_names, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
        seconds = time.perf_counter() - started
    generated = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return generated / seconds


# ---------------------------------------------------------------- report


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def round_ratio(runs: list[Run], num: str, den: str) -> float | None:
    """The median over rounds of num's tok/s ÷ den's in that round."""
    by = {(r.system, r.round_index): r for r in runs if r.ok == r.requests}
    ratios = [by[(num, i)].tokens_per_s / by[(den, i)].tokens_per_s
              for i in {r.round_index for r in runs}
              if (num, i) in by and (den, i) in by and by[(den, i)].tokens_per_s > 0]
    return median(ratios)


def report(runs: list[Run], registrations: list[float], peft: list[float], args) -> None:
    print(f"\n## LoRA adapters, {args.num_requests} requests at {args.streams} streams, "
          f"{args.adapters} adapters of rank {args.rank} ({datetime.date.today()}; "
          f"{cpu_features().describe()})")
    print("| system | output tok/s (median) | rounds |")
    print("|---|---|---|")
    for name in dict.fromkeys(r.system for r in runs):
        mine = [r.tokens_per_s for r in runs if r.system == name and r.ok == r.requests]
        failed = [r for r in runs if r.system == name and r.ok != r.requests]
        note = f" ({len(failed)} failed: {failed[0].error})" if failed else ""
        print(f"| {name} | {median(mine) or 0:.1f}{note} | {len(mine)} |")
    if peft:
        print(f"| transformers + peft generate ({args.peft_tokens} tokens each) | "
              f"{median(peft):.1f} | {len(peft)} |")
    ratios = [("kvfleet LoRA ÷ kvfleet base", "kvfleet LoRA", "kvfleet base", 0.75),
              ("kvfleet LoRA ÷ vLLM LoRA", "kvfleet LoRA", "vLLM LoRA", 1.2),
              ("vLLM LoRA ÷ vLLM base", "vLLM LoRA", "vLLM base", None),
              ("kvfleet base ÷ vLLM base", "kvfleet base", "vLLM base", None)]
    for label, num, den, target in ratios:
        value = round_ratio(runs, num, den)
        if value is not None:
            verdict = "" if target is None else f" (target ≥ {target}: " \
                f"{'met' if value >= target else 'NOT met'})"
            print(f"- {label}: {value:.2f}x{verdict}")
    kv_lora = {r.round_index: r.tokens_per_s for r in runs
               if r.system == "kvfleet LoRA" and r.ok == r.requests}
    per_round = [kv_lora[i] / tps for i, tps in enumerate(peft) if i in kv_lora and tps > 0]
    if per_round:
        print(f"- kvfleet LoRA ÷ peft generate: {median(per_round):.1f}x (median of the rounds' "
              f"ratios: {' / '.join(f'{x:.1f}' for x in per_round)})")
    if registrations:
        worst = max(registrations)
        print(f"- registration to first token: median {median(registrations):.2f} s, worst "
              f"{worst:.2f} s over {len(registrations)} (target ≤ {REGISTRATION_TARGET_S} s: "
              f"{'met' if worst <= REGISTRATION_TARGET_S else 'NOT met'})")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--b-std", type=float, default=0.01)
    p.add_argument("--adapter-dir", default=str(Path.home() / ".cache" / "kvfleet" /
                                                "bench-adapters"))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--registrations", type=int, default=3)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--peft-tokens", type=int, default=64)
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--vllm-dtype", default=None,
                   help="vLLM's --dtype (default: bfloat16 where the CPU has native bf16)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--log-dir", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    features = cpu_features()
    args.vllm_dtype = args.vllm_dtype or ("bfloat16" if features.native_bf16 else "float32")
    model_dir = resolve_model_path(DEFAULT_MODEL)
    every = make_adapters(model_dir, Path(args.adapter_dir), args.adapters + args.registrations,
                          args.rank, args.b_std)
    names = list(every)
    adapters = {n: every[n] for n in names[:args.adapters]}
    fresh = {n: every[n] for n in names[args.adapters:]}
    requests = load_trace(args.workload, args.num_requests)
    vllm = None if args.skip_vllm else vllm_python(args.vllm_venv)
    if dropped := dropped_line():
        print(dropped, flush=True)
    if vllm is None and not args.skip_vllm:
        print(f"vLLM skipped: no virtualenv with vllm ({SETUP_HINT})")
    elif vllm is not None:
        print(f"vLLM: {describe_setup(vllm, 'tuned')}")
    systems = [System("kvfleet base"), System("kvfleet LoRA", lora=True)]
    if vllm is not None:
        systems += [System("vLLM base", vllm=True), System("vLLM LoRA", vllm=True, lora=True)]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvfleet-lora-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    registrations: list[float] = []
    peft: list[float] = []  # one per round, after the servers of that round
    for round_index in range(args.rounds):
        print(f"round {round_index + 1} of {args.rounds}", flush=True)
        for system in systems:
            try:
                run, seconds = run_server(system, round_index, args, vllm, adapters, fresh,
                                          requests, log_dir)
            except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
                print(f"  {system.name}: failed ({exc}); its log: {log_dir}")
                continue
            runs.append(run)
            registrations += seconds
        if not args.skip_peft:
            peft.append(peft_tokens_per_s(model_dir, adapters, requests, args.peft_tokens,
                                          args.vllm_dtype))
            print(f"  transformers + peft: {peft[-1]:.1f} tok/s", flush=True)
    report(runs, registrations, peft, args)
    (log_dir / "runs.json").write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    print(f"logs: {log_dir}")
    return report_failures(runs)


def report_failures(runs: list[Run]) -> int:
    """1, after a line per run with failed requests, when any request failed."""
    failed = [r for r in runs if r.ok != r.requests]
    for r in failed:
        print(f"FAILED: {r.system}, round {r.round_index + 1}: {r.requests - r.ok} of "
              f"{r.requests} requests failed ({r.error})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
