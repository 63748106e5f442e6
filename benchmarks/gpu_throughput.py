"""GPU throughput of kvfleet's engine against HF `generate` and transformers' continuous batching,
on one GPU, for the default model and a randomly initialised 8B-shaped Llama (no download).

Per model, in one run and on the same weights:
  - decode: B streams with C-token contexts; kvfleet's decode steps timed alone (tokens/s, and the
    HBM bytes they move: weights + the K/V read, as GB/s and as a fraction of the card's peak),
    against HF `generate` on the same batch (its prefill timed separately and subtracted);
  - trace: the first N requests of benchmarks/data/chat-mix-64.jsonl (the chat-mix trace's first
    64) arriving at once, each with its own max_tokens, greedy, EOS ignored: kvfleet vs
    transformers' continuous batching vs HF `generate` in static batches.
Each model's rows end with the issue's targets, met or missed (8B-shaped: decode >= 70% of the HBM
roofline and >= 5x HF generate; default model: trace >= 10x transformers' continuous batching).
vLLM is not part of it: the GPU host has no network to install it.

    python -m benchmarks.gpu_throughput                 # what benchmarks/gpu_check.sh runs
    python -m benchmarks.gpu_throughput --smoke         # tiny random model on CPU, seconds (tests)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.wire import SamplingParams
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig

# The trace ships with the repository: the chat-mix trace's first 64 requests (the default
# --num-requests), verbatim.
WORKLOAD = Path(__file__).resolve().parent / "data" / "chat-mix-64.jsonl"
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)  # chat-mix fits
# HBM peak bytes/s by product name (datasheets); others fall back to a measured copy
HBM_PEAK = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
            ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
            ("L40S", 0.864e12), ("A10G", 0.6e12), ("L4", 0.3e12)]


@dataclass
class Row:
    model: str
    test: str
    system: str
    tokens: int
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hbm_peak_bytes_per_s(device: torch.device) -> tuple[float, str]:
    """(peak, where it came from): the datasheet figure for known cards, else a measured copy."""
    if device.type != "cuda":
        return 0.0, "cpu"
    name = torch.cuda.get_device_name(device)
    for key, peak in HBM_PEAK:
        if key in name:
            return peak, f"{name} datasheet"
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * 10 * x.numel() / (time.perf_counter() - start), f"{name}: measured copy"


def random_llama(shape: dict, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Randomly initialised weights, built directly on the device (no download, no CPU copy)."""
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model) -> int:
    """Weight bytes one decode step reads: all but the input embedding table, of which it reads
    only the batch's rows (a table tied to the LM head is read whole there, and counted once)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    # a CPU engine's packed head (cpu_linear.PackedLinear) holds its own copy: not tied
    head_weight = getattr(head, "weight", None)
    tied = head_weight is not None and head_weight.data_ptr() == embedding.data_ptr()
    return weight_bytes(model) - (0 if tied else embedding.numel() * embedding.element_size())


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- decode at a fixed batch and context --------------------------------------------------------


def kvfleet_decode(model, config: EngineConfig, prompts, steps: int) -> tuple[Row, dict]:
    engine = Engine(model, config)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, greedy(steps + 2))
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.stats().num_waiting:
        engine.step()
    engine.step()  # every stream is decoding from here
    sync(engine.device)
    start = time.perf_counter()
    produced = sum(len(o.new_token_ids) for _ in range(steps) for o in engine.step())
    sync(engine.device)
    seconds = time.perf_counter() - start
    context = len(prompts[0]) + steps // 2  # mean context over the timed steps
    kv_read = len(prompts) * context * engine.pool.layout.bytes_per_token
    bytes_per_step = decode_weight_bytes(model) + kv_read
    info = dict(step_ms=1e3 * seconds / steps, bytes_per_step=bytes_per_step,
                graphs=engine.runner.decode_graphs is not None,
                backend=engine.attention_backend.name)
    del engine
    return Row("", "decode", "kvfleet", produced, seconds, f"{info['step_ms']:.2f} ms/step"), info


def hf_decode(model, prompts, steps: int, device) -> Row:
    """HF generate on the same batch: (prefill + steps) minus (prefill + 1 token)."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def timed(new_tokens: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    timed(2)  # warm-up
    seconds = timed(steps + 1) - timed(1)
    return Row("", "decode", "HF generate", len(prompts) * steps, seconds)


# ---- a chat trace --------------------------------------------------------------------------------


def load_trace(path: Path, num: int, tokenizer, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) of the first `num` requests; random ids when there is no tokenizer."""
    requests = []
    generator = torch.Generator().manual_seed(0)
    with open(path) as f:
        for line in f:
            if len(requests) == num:
                break
            item = json.loads(line)
            if tokenizer is not None:
                ids = list(tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                         add_generation_prompt=True, tokenize=True)["input_ids"])
            else:  # a random model: the prompt's length in words, random ids
                ids = torch.randint(3, vocab_size, (len(item["prompt"].split()) + 8,),
                                    generator=generator).tolist()
            requests.append((ids, int(item["max_tokens"])))
    return requests


def kvfleet_trace(model, config: EngineConfig, requests) -> Row:
    engine = Engine(model, config)
    engine.generate([requests[0][0]], greedy(2))  # warm-up (kernels compiled, graphs captured)
    sync(engine.device)
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], [greedy(m) for _, m in requests])
    sync(engine.device)
    seconds = time.perf_counter() - start
    assert [len(o) for o in outputs] == [m for _, m in requests]
    del engine
    return Row("", "trace", "kvfleet", sum(map(len, outputs)), seconds)


def hf_trace_static(model, requests, batch_size: int, device) -> Row:
    """HF generate in arrival-order static batches, left-padded, each to its longest answer."""
    sync(device)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                           max_new_tokens=max(m for _, m in batch), eos_token_id=None, pad_token_id=0)
    sync(device)
    return Row("", "trace", f"HF generate (static batch {batch_size})",
               sum(m for _, m in requests), time.perf_counter() - start)


def hf_trace_continuous(model, requests, timeout_s: float, num_blocks: int | None) -> Row:
    """transformers' continuous batching manager, per-request max_new_tokens, EOS off. Timed from
    the first request in: its warm-up (CUDA graph capture) is left out, as kvfleet's is. A refused
    request, a dead generation thread or `timeout_s` without the last answer raise (and `guarded`
    turns that into a row), so the rest of the GPU session is not spent waiting."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(m for _, m in requests),
                              eos_token_id=-1, pad_token_id=0)
    # its cache sized like kvfleet's pool where that is given (--num-blocks, the smoke run), else
    # from the device's memory as transformers chooses
    cb_config = ContinuousBatchingConfig(num_blocks=num_blocks) if num_blocks else None
    produced = 0
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=60,
                                                   continuous_batching_config=cb_config) as manager:
        start = time.perf_counter()
        pending = set()
        for i, (prompt, max_tokens) in enumerate(requests):
            req_id = manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=max_tokens,
                                         eos_token_id=-1)
            if req_id is None:
                raise RuntimeError(f"request r{i} was refused")
            pending.add(req_id)
        while pending:
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"{len(pending)} of {len(requests)} requests unanswered "
                                   f"after {timeout_s:.0f} s")
            result = manager.get_result(timeout=1)
            if result is None:
                fatal = getattr(getattr(manager, "background_thread_status", None), "fatal_error", None)
                if fatal is not None:
                    raise RuntimeError(f"the generation thread died: {fatal}")
                continue
            if result.error:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    return Row("", "trace", "transformers continuous batching", produced, seconds)


# ---- one model -----------------------------------------------------------------------------------


def bench_model(name: str, model, tokenizer, args, device) -> tuple[list[Row], dict]:
    dtype = next(model.parameters()).dtype
    dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    config = EngineConfig(device=str(device), dtype=dtype_name, max_running=args.batch,
                          max_batched_tokens=args.max_batched_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          num_blocks=args.num_blocks)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, model.config.vocab_size, (args.batch, args.context),
                            generator=generator).tolist()
    rows, info = [], {}
    # on a CPU the engine fuses and packs the model's layers in place: it gets a copy, so that the
    # HF runs below see HF's own layers
    engine_model = (lambda: copy.deepcopy(model)) if device.type == "cpu" else (lambda: model)
    row, info = kvfleet_decode(engine_model(), config, prompts, args.steps)
    rows.append(row)
    requests = load_trace(Path(args.workload), args.num_requests, tokenizer, model.config.vocab_size)
    rows.append(kvfleet_trace(engine_model(), config, requests))
    cleanup()
    model.set_attn_implementation("sdpa")  # the engine had installed its paged attention
    rows.append(hf_decode(model, prompts, args.steps, device))
    if not args.skip_cb:
        rows.append(guarded(hf_trace_continuous, model, requests, args.cb_timeout_s,
                            args.num_blocks))
        model.set_attn_implementation("sdpa")
    rows.append(hf_trace_static(model, requests, args.hf_batch, device))
    for r in rows:
        r.model = name
    return rows, info


def guarded(measure, *args) -> Row:
    """transformers' continuous batching is young API: if it fails, the run goes on and its row
    says why, so one GPU session still measures everything else."""
    try:
        return measure(*args)
    except Exception as exc:  # noqa: BLE001 - any failure of the peer is reported, not fatal
        cleanup()
        return Row("", "trace", "transformers continuous batching", 0, 0.0,
                   f"failed: {type(exc).__name__}: {str(exc)[:200]}")


def cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def achieved_bytes_per_s(info: dict) -> float:
    """HBM traffic of kvfleet's timed decode steps: bytes per step / time per step."""
    return info["bytes_per_step"] / (info["step_ms"] / 1e3)


def tokens_per_s(rows: list[Row], test: str, system: str) -> float | None:
    row = next((r for r in rows if r.test == test and r.system.startswith(system)), None)
    return row.tokens_per_s if row is not None and row.seconds > 0 else None


def targets(name: str, rows: list[Row], info: dict, peak: float) -> list[tuple[str, float | None, float]]:
    """The issue's targets that apply to this model: (what, measured value or None, bound)."""
    mine = tokens_per_s(rows, "decode", "kvfleet")
    if name == "8b":
        hf = tokens_per_s(rows, "decode", "HF generate")
        return [("decode HBM fraction of peak", achieved_bytes_per_s(info) / peak if peak else None, 0.70),
                ("decode kvfleet / HF generate", mine / hf if mine and hf else None, 5.0)]
    if name == "default":
        mine = tokens_per_s(rows, "trace", "kvfleet")
        cb = tokens_per_s(rows, "trace", "transformers continuous batching")
        return [("trace kvfleet / transformers CB", mine / cb if mine and cb else None, 10.0)]
    return []


def report(name: str, rows: list[Row], info: dict, peak: float, peak_source: str) -> list[str]:
    """The rows as gpu_check.sh prints them: per test, every system's tokens/s and kvfleet's
    ratio to it; the HBM line; the targets."""
    lines = []
    for test in ("decode", "trace"):
        mine = next((r for r in rows if r.test == test and r.system == "kvfleet"), None)
        for r in (x for x in rows if x.test == test):
            if r.seconds <= 0:  # a peer that failed
                lines.append(f"  {r.model:10s} {test:6s} {r.system:40s} {'-':>10s}       {r.note}")
                continue
            ratio = f"  kvfleet = {mine.tokens_per_s / r.tokens_per_s:.2f}x" if r is not mine else ""
            lines.append(f"  {r.model:10s} {test:6s} {r.system:40s} {r.tokens_per_s:10.1f} tok/s "
                         f"({r.tokens} tokens, {r.seconds:.2f} s){ratio} {r.note}")
    if info:
        achieved = achieved_bytes_per_s(info)
        fraction = (f"{achieved / peak:.0%} of {peak / 1e9:.0f} GB/s ({peak_source})" if peak
                    else f"no HBM peak known on {peak_source}")
        lines.append(f"  {name:10s} HBM: {achieved / 1e9:.1f} GB/s achieved in kvfleet's decode "
                     f"steps = {fraction}; {info['bytes_per_step'] / 1e9:.3f} GB per step; backend "
                     f"{info['backend']}, CUDA graphs {'on' if info['graphs'] else 'off'}")
    for what, measured, bound in targets(name, rows, info, peak):
        shown = "not measured" if measured is None else f"{measured:.2f}"
        verdict = "n/a" if measured is None else ("met" if measured >= bound else "MISSED")
        lines.append(f"  {name:10s} target: {what} >= {bound:g}: {shown} {verdict}")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,8b", help="comma-separated: default, 8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--num-requests", type=int, default=64, help="trace requests")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--workload", default=str(WORKLOAD))
    parser.add_argument("--skip-cb", action="store_true")
    parser.add_argument("--cb-timeout-s", type=float, default=150.0,
                        help="give up on transformers' continuous batching after this long")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny random model on CPU, small sizes: checks the script runs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.models, args.batch, args.context, args.steps = "tiny", 4, 24, 4
        args.num_requests, args.hf_batch, args.num_blocks = 4, 2, 128
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    peak, peak_source = hbm_peak_bytes_per_s(device)
    print(f"  device {device}; trace {args.workload}", flush=True)
    all_rows, decode = [], {}
    for name in args.models.split(","):
        cleanup()
        if name == "default":
            path = resolve_model_path(DEFAULT_MODEL)
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
            tokenizer = load_tokenizer(path)
        else:
            shape, dtype = (LLAMA_8B, torch.bfloat16) if name == "8b" else (TINY, torch.float32)
            model, tokenizer = random_llama(shape, device, dtype), None
        rows, info = bench_model(name, model, tokenizer, args, device)
        for line in report(name, rows, info, peak, peak_source):
            print(line, flush=True)
        all_rows += rows
        decode[name] = dict(info, hbm_bytes_per_s=achieved_bytes_per_s(info),
                            targets=[dict(what=w, measured=m, bound=b)
                                     for w, m, b in targets(name, rows, info, peak)])
        del model
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=str(device), hbm_peak_bytes_per_s=peak, hbm_peak_source=peak_source,
            workload=str(args.workload), rows=[asdict(r) for r in all_rows], decode=decode),
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
