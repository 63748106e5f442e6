"""The benchmark clients people trust, each unmodified, against `kvfleet up` (and vLLM's CPU
server), side by side with kvfleet's own `kvfleet bench` on the same requests: does kvfleet's
client measure what theirs measure, and does kvfleet serve the request shapes they send?

    bash benchmarks/vllm_env.sh && bash benchmarks/clients_env.sh    # the clients' virtualenvs
    .venv/bin/python -m benchmarks.clients                           # kvfleet, then vLLM
    .venv/bin/python -m benchmarks.clients --no-vllm --clients guidellm,aiperf
    .venv/bin/python -m benchmarks.clients --num-prompts 48 --max-concurrency 32 --output-len 128
    .venv/bin/python -m benchmarks.clients --simulated --no-vllm     # a server no client can slow

With `--simulated` kvfleet serves from one simulated worker (`kvfleet up --workers 0
--sim-workers 1 --sim-device h100`): the real gateway, Redis, scheduler and protocol, each step
the time an H100 takes x `--sim-time-scale`. On a machine of few cores a client's own CPU is
taken from a real worker, so each client measures a slower server than kvfleet bench does; a
simulated worker's steps are the same whatever the client, so there the figures compare the
clients themselves (docs/BENCHMARKS.md, "The clients agree with kvfleet bench ...").

The clients, each from its own virtualenv (vLLM's, benchmarks/vllm_env.sh; GuideLLM's and
AIPerf's, benchmarks/clients_env.sh), run from a scratch directory, not the checkout:
- `vllm bench serve` on its `random` dataset and on its `prefix_repetition` one (4 prefixes of
  512 tokens, 64-token suffixes, 96 out: benchmarks/bench_serve.py's workloads and result files);
- GuideLLM (`guidellm run`, a concurrent profile, synthetic text of the random workload's shape);
- AIPerf (`aiperf profile`, completions, streaming, synthetic prompts of the same shape,
  `--extra-inputs ignore_eos:true`).
Every request is a streamed /v1/completions request with the fixed output length and
`ignore_eos` (GuideLLM adds `stream_options.continuous_usage_stats` and `stop: null`), `--max-
concurrency` in flight, `--num-prompts` in all, no temperature (the server's default).

The servers are started with `--served-model-name <hub id>` (the default model's:
HuggingFaceTB/SmolLM2-135M-Instruct) and every client is given that name, as a model and as its
tokenizer, with the hubs off (HF_HUB_OFFLINE=1): the name is found in the local Hugging Face
cache, or, where it is not there, in a cache of this script's (~/.cache/kvfleet/hf-home) whose
entry for that name holds kvfleet's converted model directory's tokenizer and config (no
weights): nothing is downloaded.

Right after each client's run, `kvfleet bench` sends the same requests to the same server: vLLM's
dataset of that workload (sampled by vLLM's own code, `vllm bench serve`'s sampler, with the
same tokenizer, lengths, count and concurrency, every prompt of exactly its length), for GuideLLM
and AIPerf, whose synthetic prompts are their own, the random one. Not the very prompts just
sent: both servers keep a prefix cache, and a replay finds them cached (measured: replaying
`vllm bench serve`'s 32 random prompts right after it, kvfleet bench found 6,144 of their 8,192
prompt tokens cached and read 1.46x the client's output tok/s). So every run is cache-cold:
kvfleet bench's trace for a client's run is sampled with a seed of its own (`--seed` + 1 + the
run's index), and with `--repeats N` each round r gives every seed + 100 r, the clients' too.
In odd rounds kvfleet bench runs first, the client after it.

The table gives each client's figures as the client computed them (output tok/s, TTFT p50/p99,
TPOT p50: (latency - TTFT) / (tokens - 1), what GuideLLM and AIPerf call ITL; tokens in and out
as it counted them), kvfleet bench's beside them, the client's output tok/s over kvfleet
bench's, and each one's CPU time (on a machine of few cores a client's own work is taken from the
server's); then per client the median of the rounds' ratios: within `--tolerance` (5%) it
agrees, else DISAGREES. Any failed request fails the run (exit 1, after the tables); with
`--strict` so does a disagreement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.bench_serve import run_client as run_vllm_client, workload_args
from benchmarks.http_peers import free_port, kvfleet_server, stop_session, wait_first_answer
from benchmarks.peer_env import dropped_line, peer_env
from benchmarks.vllm_peer import REPO, SETUP_HINT, VllmServer, describe_setup, vllm_python
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path, served_model_id

CACHE = Path.home() / ".cache" / "kvfleet"
HUB_IDS = {DEFAULT_MODEL: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # what the hub calls a model
CLIENTS_HINT = "make them with `bash benchmarks/clients_env.sh`"
# the jobs: (client, workload); GuideLLM and AIPerf send the random workload's shape
JOBS = {"vllm-random": ("vllm bench serve", "random"),
        "vllm-prefix": ("vllm bench serve", "prefix"),
        "guidellm": ("GuideLLM", "random"), "aiperf": ("AIPerf", "random"),
        # the control, not run by default: kvfleet bench against itself (other prompts of the
        # same dataset), the host's own spread between two runs minutes apart
        "kvfleet-bench": ("kvfleet bench", "random")}
DEFAULT_JOBS = ("vllm-random", "vllm-prefix", "guidellm", "aiperf")
# vLLM's dataset as `vllm bench serve` samples it (the same arguments and seeds as its main),
# written as kvfleet bench's trace: argv[1] the trace, the client's own arguments after it
SAMPLER = ("import json, random, sys\n"
           "import numpy as np\n"
           "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
           "from vllm.benchmarks.serve import add_cli_args\n"
           "from vllm.benchmarks.datasets import get_samples\n"
           "from vllm.tokenizers import get_tokenizer\n"
           "parser = FlexibleArgumentParser()\n"
           "add_cli_args(parser)\n"
           "args = parser.parse_args(sys.argv[2:])\n"
           "random.seed(args.seed)\n"
           "np.random.seed(args.seed)\n"
           "tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode)\n"
           "with open(sys.argv[1], 'w') as out:\n"
           "    for s in get_samples(args, tokenizer):\n"
           "        out.write(json.dumps({'t': 0, 'prompt': s.prompt, 'ignore_eos': True,\n"
           "                              'max_tokens': s.expected_output_len}) + '\\n')\n")


@dataclass
class Figures:
    """One run as its client reported it."""
    client: str
    completed: int
    failed: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float  # per request (latency - TTFT) / (output tokens - 1), the median
    input_tokens: int  # as the client counted them (kvfleet bench: the server's usage)
    output_tokens: int
    first_error: str | None = None
    # the client's processes' CPU time (user + system) over its run: on a machine of few cores
    # the client's own work is taken from the server's
    client_cpu_s: float | None = None


@dataclass
class Pair:
    """A client's run and kvfleet bench's on the same requests, the same server, right after."""
    server: str
    workload: str
    client: Figures
    reference: Figures  # kvfleet bench's
    round: int = 1

    @property
    def ratio(self) -> float:
        return self.client.output_tok_s / self.reference.output_tok_s

    def agrees(self, tolerance: float) -> bool:
        return abs(self.ratio - 1.0) <= tolerance


def first(errors) -> str | None:
    return next((str(e)[:300] for e in errors if e), None)


def vllm_figures(doc: dict) -> Figures:
    """`vllm bench serve`'s result file (--percentile-metrics ttft,tpot,itl
    --metric-percentiles 50,99)."""
    return Figures("vllm bench serve", int(doc["completed"]), int(doc["failed"]),
                   float(doc["output_throughput"]), float(doc["p50_ttft_ms"]),
                   float(doc["p99_ttft_ms"]), float(doc["p50_tpot_ms"]),
                   int(doc["total_input_tokens"]), int(doc["total_output_tokens"]),
                   first(doc.get("errors", [])))


def guidellm_figures(doc: dict) -> Figures:
    """GuideLLM's JSON report (`--output kind=json`), its one benchmark: output tokens per
    second over the benchmark (the `mean` of its distribution is total / duration), the
    successful requests' TTFT, and its ITL ((latency - TTFT) / (tokens - 1), vLLM's TPOT)."""
    (benchmark,) = doc["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    errors = [(r.get("info") or {}).get("error") or r.get("error")
              for r in (benchmark.get("requests") or {}).get("errored", [])]
    return Figures("GuideLLM", int(totals["successful"]),
                   int(totals["errored"]) + int(totals["incomplete"]),
                   float(metrics["output_tokens_per_second"]["successful"]["mean"]),
                   float(ttft["median"]), float(ttft["percentiles"]["p99"]),
                   float(metrics["inter_token_latency_ms"]["successful"]["median"]),
                   round(metrics["prompt_token_count"]["successful"]["total_sum"]),
                   round(metrics["output_token_count"]["successful"]["total_sum"]),
                   first(errors) or (f"{totals['errored']} errored" if totals["errored"] else None))


def aiperf_figures(doc: dict) -> Figures:
    """AIPerf's profile_export_aiperf.json: output token throughput over the benchmark, TTFT,
    and its ITL ((latency - TTFT) / (tokens - 1), vLLM's TPOT). Its output tokens are counted by
    tokenizing the answers' text, as it does by default (not the server's usage)."""
    sent = int(doc["request_count"]["avg"])
    failed = int((doc.get("error_request_count") or {}).get("avg", 0))
    ttft = doc["time_to_first_token"]
    errors = [f"{e.get('count')} x {e.get('error_details', e)}" for e in doc.get("error_summary")
              or []]
    return Figures("AIPerf", sent - failed, failed, float(doc["output_token_throughput"]["avg"]),
                   float(ttft["p50"]), float(ttft["p99"]),
                   float(doc["inter_token_latency"]["p50"]),
                   round(doc["total_isl"]["avg"]), round(doc["total_output_tokens"]["avg"]),
                   first(errors))


def kvfleet_bench_figures(doc: dict) -> Figures:
    """kvfleet bench's results.json: the summary's throughput and TTFT, and TPOT per request
    from its records (its summary gives per-token gaps, not per-request TPOT)."""
    summary = doc["summary"]
    ok = [r for r in doc["requests"] if r["ok"]]
    tpots = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok
             if r["output_tokens"] and r["output_tokens"] > 1]
    return Figures("kvfleet bench", int(summary["num_ok"]), int(summary["num_errors"]),
                   float(summary["output_tokens_per_s"]), summary["ttft_s"]["p50"] * 1000,
                   summary["ttft_s"]["p99"] * 1000,
                   statistics.median(tpots) * 1000 if tpots else float("nan"),
                   sum(r["prompt_tokens"] or 0 for r in ok), int(summary["total_output_tokens"]),
                   first(summary.get("errors") or {}))


def table(pairs: list[Pair], tolerance: float) -> list[str]:
    """Each client's row, kvfleet bench's on the same requests under it, and the client's output
    tok/s over kvfleet bench's."""
    lines = ["| server | workload | client | completed | failed | tokens in / out | output tok/s | "
             "TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | tok/s / kvfleet bench's | "
             "client CPU (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for pair in pairs:
        verdict = "agrees" if pair.agrees(tolerance) else "**DISAGREES**"
        rounds = f" (round {pair.round})" if len({p.round for p in pairs}) > 1 else ""
        for figures, ratio in ((pair.client, f"{pair.ratio:.3f} ({verdict})"),
                               (pair.reference, "")):
            lines.append(f"| {pair.server} | {pair.workload} | {figures.client}{rounds} | "
                         f"{figures.completed} | {figures.failed} | "
                         f"{figures.input_tokens} / {figures.output_tokens} | "
                         f"{figures.output_tok_s:.1f} | {figures.ttft_p50_ms:.0f} | "
                         f"{figures.ttft_p99_ms:.0f} | {figures.tpot_p50_ms:.1f} | {ratio} | "
                         f"{_cpu(figures.client_cpu_s)} |")
    return lines


def groups(pairs: list[Pair]) -> dict[tuple[str, str, str], list[Pair]]:
    """The pairs of each (server, workload, client), over the rounds."""
    grouped: dict[tuple[str, str, str], list[Pair]] = {}
    for pair in pairs:
        grouped.setdefault((pair.server, pair.workload, pair.client.client), []).append(pair)
    return grouped


def agreement(pairs: list[Pair], tolerance: float) -> list[str]:
    """Per server, workload and client: the median over the rounds of the client's output tok/s
    over kvfleet bench's (each round's pair ran minutes apart, not the rounds), and each round's;
    the verdict is the median's."""
    lines = ["| server | workload | client | rounds | median tok/s ratio | every round's | "
             "verdict |", "|---|---|---|---:|---:|---|---|"]
    for (server, workload, client), mine in groups(pairs).items():
        ratio = statistics.median(p.ratio for p in mine)
        verdict = "agrees" if abs(ratio - 1) <= tolerance else "**DISAGREES**"
        lines.append(f"| {server} | {workload} | {client} | {len(mine)} | {ratio:.3f} | "
                     f"{' / '.join(f'{p.ratio:.3f}' for p in mine)} | {verdict} |")
    return lines


def _cpu(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children so far (a client is one once it ends)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def verdicts(pairs: list[Pair], tolerance: float) -> tuple[list[str], list[str]]:
    """(failed runs, disagreements), a line each."""
    failed = [f"FAILED: {p.server}, {p.workload}, {f.client}: {f.failed} requests failed "
              f"({f.first_error})" for p in pairs for f in (p.client, p.reference) if f.failed]
    apart = []
    for (server, workload, client), mine in groups(pairs).items():
        ratio = statistics.median(p.ratio for p in mine)
        if abs(ratio - 1) > tolerance:
            apart.append(f"DISAGREES: {server}, {workload}, {client}: output tok/s "
                         f"{ratio:.3f} of kvfleet bench's (median of {len(mine)} rounds: "
                         f"{' / '.join(f'{p.ratio:.3f}' for p in mine)}), beyond "
                         f"{tolerance:.0%}")
    return failed, apart


def hub_home(name: str, model_dir: str, root: Path = CACHE / "hf-home") -> dict[str, str]:
    """The clients' Hugging Face variables: the hubs off, and HF_HOME where `name` is found
    offline: this process's cache when it holds the name, else `root`, whose entry for the name
    links `model_dir`'s files but its weights (a revision named `kvfleet-local`)."""
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if Path(name).is_dir() or _in_hub_cache(name, None):
        return offline
    entry = root / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = entry / "snapshots" / "kvfleet-local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for source in Path(model_dir).iterdir():
        if source.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            continue
        link = snapshot / source.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source.resolve())
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text("kvfleet-local")
    home = {**offline, "HF_HOME": str(root)}
    if not _in_hub_cache(name, str(root)):
        raise RuntimeError(f"{name} is not found in the cache made in {root}")
    return home


def _in_hub_cache(name: str, hf_home: str | None) -> bool:
    """Whether a tokenizer named `name` loads offline with this HF_HOME (None: the caller's)."""
    env = peer_env({"HF_HUB_OFFLINE": "1", **({"HF_HOME": hf_home} if hf_home else {})})
    check = subprocess.run([sys.executable, "-c", "import sys\nfrom transformers import "
                            "AutoTokenizer\nAutoTokenizer.from_pretrained(sys.argv[1])", name],
                           env=env, capture_output=True, timeout=300)
    return check.returncode == 0


def client_python(name: str, venv: str | None) -> Path | None:
    """The python of GuideLLM's or AIPerf's virtualenv (benchmarks/clients_env.sh), if there."""
    root = Path(venv or os.environ.get(f"KVFLEET_{name.upper()}_VENV") or CACHE / f"{name}-venv")
    python = root / "bin" / "python"
    return python if python.exists() else None


def run(command: list[str], what: str, out: Path, log: Path, env: dict[str, str]) -> dict:
    """Run a client from the scratch directory (this process's working directory); its result
    file, read as JSON."""
    out.unlink(missing_ok=True)
    with open(log, "w") as log_file:
        done = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{what} exited with code {done.returncode}: "
                           f"{log.read_text()[-2000:]}")
    return json.loads(out.read_text())


def run_guidellm(python: Path, url: str, served: str, args, seed: int, tmp: Path,
                 tag: str) -> Figures:
    out = tmp / f"guidellm{tag}.json"
    command = [str(python), "-m", "guidellm", "run",
               "--backend", f"kind=openai_http,target={url},model={served},"
                            "request_format=/v1/completions",
               "--profile", f"kind=concurrent,streams={args.max_concurrency}",
               "--constraint", f"kind=max_requests,count={args.num_prompts}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},"
                         f"output_tokens={args.output_len}",
               "--tokenizer", f"kind=hf_auto,model={served}",
               "--seed", f"kind=static,value={seed}",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    return guidellm_figures(run(command, "GuideLLM", out, tmp / f"guidellm{tag}.log",
                                peer_env(args.hub_env)))


def run_aiperf(python: Path, url: str, served: str, args, seed: int, tmp: Path,
               tag: str) -> Figures:
    artifacts = tmp / f"aiperf{tag}"
    command = [str(python), "-m", "aiperf", "profile", "--model", served, "--url", url,
               "--endpoint-type", "completions", "--streaming", "--tokenizer", served,
               "--prompt-input-tokens-mean", str(args.input_len),
               "--prompt-input-tokens-stddev", "0",
               "--prompt-output-tokens-mean", str(args.output_len),
               "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
               "--concurrency", str(args.max_concurrency), "--request-count",
               str(args.num_prompts), "--random-seed", str(seed), "--ui-type", "none",
               "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(artifacts)]
    return aiperf_figures(run(command, "AIPerf", artifacts / "profile_export_aiperf.json",
                              tmp / f"aiperf{tag}.log", peer_env(args.hub_env)))


def vllm_args(args, seed: int) -> argparse.Namespace:
    """bench_serve's arguments for `vllm bench serve`, from this script's."""
    return argparse.Namespace(random_input_len=args.input_len, random_output_len=args.output_len,
                              num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                              seed=seed)


def trace_of(vllm: Path, served: str, workload: str, args, seed: int, tmp: Path) -> Path:
    """The requests `vllm bench serve` sends on `workload` with `--seed seed`, as a kvfleet bench
    trace (made once)."""
    path = tmp / f"trace-{workload}-seed{seed}.jsonl"
    if not path.exists():
        command = [str(vllm), "-c", SAMPLER, str(path), "--backend", "openai", "--model", served,
                   "--tokenizer", served, *workload_args(workload, vllm_args(args, seed)),
                   "--num-prompts", str(args.num_prompts), "--seed", str(seed)]
        done = subprocess.run(command, env=peer_env(args.hub_env), capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"sampling vLLM's {workload} dataset failed: {done.stderr[-2000:]}")
    return path


def run_kvfleet_bench(url: str, served: str, trace: Path, args, out: Path) -> Figures:
    """kvfleet bench on `trace`, closed loop at the clients' concurrency, no temperature sent
    (the server's default, as the clients)."""
    command = [sys.executable, "-m", "kvfleet", "bench", str(trace), "--url", url, "--model",
               served, "--endpoint", "completions", "--concurrency", str(args.max_concurrency),
               "--num-requests", str(args.num_prompts), "--no-plots", "--no-progress",
               "--out", str(out), "--timeout", "3600"]
    results = out / "results.json"
    results.unlink(missing_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode not in (0, 1) or not results.exists():  # 1: some request failed
        raise RuntimeError(f"kvfleet bench against {url} exited with code {done.returncode}")
    return kvfleet_bench_figures(json.loads(results.read_text()))


def run_jobs(server: str, url: str, args, tools: dict, tmp: Path, round_index: int) -> list[Pair]:
    """Every client once against `url`, each followed by kvfleet bench (preceded by it in odd
    rounds, so that a drift of the host over a pair does not always favour the same side)."""
    pairs = []
    seed = args.seed + 100 * round_index  # a round's prompts are new to the server
    for index, job in enumerate(args.clients):
        client, workload = JOBS[job]
        tag = f"-{server.lower()}-{job}-{round_index + 1}"
        # prompts no earlier run on this server sent (its prefix cache holds those)
        trace = trace_of(tools["vllm"], args.served, workload, args, seed + 1 + index, tmp)
        control = (trace_of(tools["vllm"], args.served, workload, args, seed + 50, tmp)
                   if client == "kvfleet bench" else None)

        def measure_client() -> Figures:
            if client == "vllm bench serve":
                # bench_serve's run: its --tokenizer is the served name, found offline here
                return vllm_figures(run_vllm_client(tools["vllm"], url, args.served, args.served,
                                                    workload, vllm_args(args, seed),
                                                    tmp / f"vllm{tag}.json"))
            if client == "kvfleet bench":
                figures = run_kvfleet_bench(url, args.served, control, args,
                                            tmp / f"kvfleet-bench-control{tag}")
                figures.client = "kvfleet bench (control)"
                return figures
            if client == "GuideLLM":
                return run_guidellm(tools["guidellm"], url, args.served, args, seed, tmp, tag)
            return run_aiperf(tools["aiperf"], url, args.served, args, seed, tmp, tag)

        def measure_reference() -> Figures:
            return run_kvfleet_bench(url, args.served, trace, args, tmp / f"kvfleet-bench{tag}")

        order = [("client", measure_client), ("reference", measure_reference)]
        measured = {}
        for name, measure in order[::-1] if round_index % 2 else order:
            cpu = children_cpu_s()
            measured[name] = measure()
            measured[name].client_cpu_s = children_cpu_s() - cpu
        pair = Pair(server, workload_name(workload, args), measured["client"],
                    measured["reference"], round_index + 1)
        print("\n".join(table([pair], args.tolerance)[2:]), flush=True)
        pairs.append(pair)
    return pairs


def workload_name(workload: str, args) -> str:
    if workload == "random":
        return f"random {args.input_len}/{args.output_len}"
    return "prefix 4x512+64/96"


def kvfleet_pairs(args, tools: dict, tmp: Path) -> list[Pair]:
    port = free_port()
    process = kvfleet_server(port, args.kvfleet_dtype, tmp / "kvfleet.log", args.model,
                             extra=["--served-model-name", args.served,
                                    *args.kvfleet_args.split()])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_first_answer(url, args.served, process, args.startup_timeout_s)
        return [pair for index in range(args.repeats)
                for pair in run_jobs("kvfleet", url, args, tools, tmp, index)]
    finally:
        stop_session(process)


def vllm_pairs(args, tools: dict, model_dir: str, tmp: Path) -> list[Pair]:
    server = VllmServer(tools["vllm"], model_dir, free_port(), args.vllm_dtype, tmp / "vllm.log",
                        served_name=args.served, setup="tuned")
    try:
        wait_first_answer(server.url, args.served, server.process, args.startup_timeout_s)
        return [pair for index in range(args.repeats)
                for pair in run_jobs("vLLM", server.url, args, tools, tmp, index)]
    finally:
        server.stop()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="what the servers serve: the default model, a directory, random:<shape>")
    p.add_argument("--served-model-name", default=None,
                   help="the name both servers serve it under and every client asks for (and "
                        "loads its tokenizer by); default: its hub id where known, else its id")
    p.add_argument("--clients", default=",".join(DEFAULT_JOBS),
                   type=lambda s: [c for c in s.split(",") if c],
                   help=f"which runs, in order, of {', '.join(JOBS)} (kvfleet-bench: the "
                        "control, kvfleet bench as the client)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256, help="the random workload's prompts")
    p.add_argument("--output-len", type=int, default=96, help="the random workload's answers")
    p.add_argument("--seed", type=int, default=0,
                   help="the clients' seed in the first round (round r: + 100 r); kvfleet "
                        "bench's traces: + 1 + the run's index")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every run against each server (started once); the verdict "
                        "is the median of the rounds' ratios")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="how far a client's output tok/s may be from kvfleet bench's")
    p.add_argument("--strict", action="store_true", help="a disagreement fails the run too")
    p.add_argument("--kvfleet-dtype", default="auto")
    p.add_argument("--kvfleet-args", default="", help="more arguments for `kvfleet up`")
    p.add_argument("--simulated", action="store_true",
                   help="kvfleet's fleet with one simulated worker instead of its real one "
                        "(`--workers 0 --sim-workers 1 --sim-device h100`): the real gateway, "
                        "Redis, scheduler and protocol, each step the time an H100 takes x "
                        "--sim-time-scale, which no client's CPU can slow")
    p.add_argument("--sim-time-scale", type=float, default=100,
                   help="with --simulated: the steps' times x this (100: about 50 ms a decode "
                        "step of 16 streams of the default model)")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--guidellm-venv", default=None)
    p.add_argument("--aiperf-venv", default=None)
    p.add_argument("--no-vllm", action="store_true", help="kvfleet's server only")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' logs, the traces and the clients' result files here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if unknown := set(args.clients) - set(JOBS):
        p.error(f"--clients: unknown {sorted(unknown)}; choose from {', '.join(JOBS)}")
    args.served = args.served_model_name or HUB_IDS.get(args.model, served_model_id(args.model))
    if args.simulated:  # `kvfleet up` takes the last of a repeated flag: --workers 0 wins
        args.kvfleet_args = (f"--workers 0 --sim-workers 1 --sim-device h100 --sim-time-scale "
                             f"{args.sim_time_scale:g} {args.kvfleet_args}").strip()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    tools = {"vllm": vllm_python(args.vllm_venv)}
    if tools["vllm"] is None:  # its client and its dataset sampler (kvfleet bench's traces)
        raise SystemExit(f"no virtualenv with vllm found; {SETUP_HINT}")
    for name in ("guidellm", "aiperf"):
        if any(job == name for job in args.clients):
            tools[name] = client_python(name, getattr(args, f"{name}_venv"))
            if tools[name] is None:
                raise SystemExit(f"no virtualenv with {name} found; {CLIENTS_HINT}")
    model_dir = resolve_model_path(args.model)
    args.hub_env = hub_home(args.served, model_dir)
    # every client finds the tokenizer offline by the served name, `vllm bench serve` too
    # (benchmarks/bench_serve.py runs it with this process's environment)
    os.environ.update(args.hub_env)
    print(f"# CPU {cpu_features().describe()}; model {args.model} served as {args.served} "
          f"(tokenizer: {args.hub_env.get('HF_HOME', 'the local HF cache')}, offline); "
          f"{args.num_prompts} prompts, {args.max_concurrency} in flight, ignore_eos; "
          f"kvfleet --dtype {args.kvfleet_dtype} {args.kvfleet_args}; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    if not args.no_vllm:
        print(f"# vLLM --dtype {args.vllm_dtype}, tuned: {describe_setup(tools['vllm'], 'tuned')}",
              flush=True)
    if dropped := dropped_line():
        print(dropped, flush=True)
    with tempfile.TemporaryDirectory(prefix="kvfleet-clients-") as tmp_name:
        tmp = Path(args.log_dir or tmp_name).resolve()
        tmp.mkdir(parents=True, exist_ok=True)
        scratch = Path(tmp_name) / "cwd"  # the clients run from here, not from the checkout
        scratch.mkdir()
        here = os.getcwd()
        os.chdir(scratch)
        try:
            pairs = kvfleet_pairs(args, tools, tmp)
            print(f"# load average {os.getloadavg()[0]:.1f}", flush=True)
            if not args.no_vllm:
                pairs += vllm_pairs(args, tools, model_dir, tmp)
        finally:
            os.chdir(here)
    print()
    print("\n".join(table(pairs, args.tolerance)))
    print()
    print("\n".join(agreement(pairs, args.tolerance)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            [{"server": p.server, "workload": p.workload, "round": p.round, "ratio": p.ratio,
              "client": asdict(p.client), "kvfleet_bench": asdict(p.reference)} for p in pairs],
            indent=2))
    failed, apart = verdicts(pairs, args.tolerance)
    for line in failed + apart:
        print(line, flush=True)
    return 1 if failed or (args.strict and apart) else 0


if __name__ == "__main__":
    sys.exit(main())
