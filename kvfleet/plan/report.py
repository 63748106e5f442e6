"""Renders a capacity `Plan` for an operator: a plain-text table that shows the seed's reasoning
step by step, or a JSON document with the same numbers (bytes as integers, GB as decimals)."""

from __future__ import annotations

from dataclasses import asdict

from kvfleet.plan.capacity import ContextFit, Plan, PlanInputs
from kvfleet.plan.pace import MeasuredPace
from kvfleet.text.units import format_bytes, format_money, format_number

_INDENT = "  "


def plan_to_json(plan: Plan, inputs: PlanInputs, pace: MeasuredPace | None = None) -> dict:
    """The plan; `measured_pace` says where streams and tokens/s came from (null: the flags)."""
    document = asdict(plan)
    memory = document["memory"]
    for key in ("gpu_memory", "weights", "free_kv"):
        memory[f"{key}_gb"] = memory[f"{key}_bytes"] / 1e9
    for fit in document["contexts"] + ([document["mix"]] if document["mix"] else []):
        fit["kv_gb_per_conversation"] = fit["kv_bytes_per_conversation"] / 1e9
    document["inputs"] = asdict(inputs)
    document["measured_pace"] = pace.as_json() if pace else None
    return document


def plan_to_text(plan: Plan, inputs: PlanInputs, pace: MeasuredPace | None = None) -> str:
    sections = [_memory_lines(plan, inputs), _context_lines(plan),
                _pace_lines(pace) + _throughput_lines(plan),
                _cost_lines(plan), _what_if_lines(plan), _warning_lines(plan)]
    return "\n".join(line for section in sections for line in section + [""]).rstrip() + "\n"


def _memory_lines(plan: Plan, inputs: PlanInputs) -> list[str]:
    memory = plan.memory
    n = memory.tensor_parallel_size
    if n == 1:
        title, weights = "Memory (one accelerator)", (
            f"{format_number(inputs.num_params, 0)} params × "
            f"{format_number(inputs.bytes_per_param)} B = {format_bytes(memory.weights_bytes)}")
    else:
        shared = min(inputs.replicated_params, inputs.num_params)
        title = f"Memory (per rank: a worker is {n} accelerators, tensor parallel)"
        weights = (f"({format_number(inputs.num_params - shared, 0)} split ÷ {n} + "
                   f"{format_number(shared, 0)} whole) params × "
                   f"{format_number(inputs.bytes_per_param)} B = {format_bytes(memory.weights_bytes)}")
    return [
        title,
        _row("weights", weights),
        _row("accelerator memory", format_bytes(memory.gpu_memory_bytes)),
        _row("free for KV cache", f"{format_bytes(memory.gpu_memory_bytes)} - "
                                  f"{format_bytes(memory.weights_bytes)} = "
                                  f"{format_bytes(memory.free_kv_bytes)}"),
        _row("KV per token", f"{format_bytes(memory.kv_bytes_per_token)} "
                             + (f"per rank of {format_bytes(inputs.kv_bytes_per_token)} "
                                if n > 1 else "")
                             + f"({memory.kv_dtype}, {inputs.kv_source}) -> "
                             f"{format_number(memory.tokens_that_fit, 0)} tokens fit"
                             + (" per worker" if n > 1 else "")),
    ]


def _context_lines(plan: Plan) -> list[str]:
    per = "accelerator" if plan.memory.tensor_parallel_size == 1 else \
        f"worker ({plan.memory.tensor_parallel_size} accelerators)"
    lines = [f"Conversations per {per}",
             f"{_INDENT}{'context tokens':>16}  {'mix':>5}  {'KV/conversation':>16}  "
             f"{'conversations':>13}"]
    for fit in plan.contexts:
        lines.append(_context_row(format_number(fit.context_tokens, 0), fit))
    if plan.mix:
        lines.append(_context_row(f"mix avg {format_number(plan.mix.context_tokens, 0)}",
                                  plan.mix))
    return lines


def _context_row(label: str, fit: ContextFit) -> str:
    weight = "" if fit.mix_weight is None else f"{fit.mix_weight:.0%}"
    return (f"{_INDENT}{label:>16}  {weight:>5}  {format_bytes(fit.kv_bytes_per_conversation):>16}"
            f"  {fit.conversations_per_gpu:>13,}")


def _pace_lines(pace: MeasuredPace | None) -> list[str]:
    """Where the throughput's streams and tokens/s came from, when a measured curve gave them."""
    if pace is None:
        return []
    return [
        "Measured pace (the step-cost curve, not --streams / --gpu-tokens-per-s)",
        _row("curve", f"{pace.source} ({pace.curve.steps:,} steps fitted)"),
        _row("target ITL", f"{format_number(pace.target_itl_ms)} ms p99, streams of "
                           f"{format_number(pace.context_tokens, 0)} tokens"),
        *_prefill_rows(pace),
        _row("streams at pace", f"{pace.streams:,} per worker"
             + (f" ({pace.streams_decode_only:,} counting the decode steps only)"
                if pace.streams_decode_only != pace.streams else "")),
        _row("tokens/s at pace", f"{format_number(pace.tokens_per_s)} per worker"),
        "",
    ]


def _prefill_rows(pace: MeasuredPace) -> list[str]:
    """The prefill share the streams at pace were counted with: each stream that ends is
    replaced by one whose prompt is prefilled, so a step carries U / O prompt tokens a stream."""
    p = pace.prefill
    cached = (f" ({format_number(p.uncached_tokens, 0)} uncached)" if p.prefix_share else "")
    prompts = _row("request", f"{format_number(p.prompt_tokens, 0)} prompt tokens{cached} and "
                              f"{format_number(p.output_tokens, 0)} output tokens ({p.source})")
    if p.uncached_tokens <= 0:
        return [prompts, _row("prefill at pace", "none counted (no uncached prompt tokens)")]
    free = "" if p.seconds_per_stream(pace.curve) > 0 else " (the curve gives prefill no cost)"
    return [prompts, _row("prefill at pace",
                          f"{format_number(p.tokens_per_stream)} prompt tokens a stream a step, "
                          f"{format_number(pace.prefill_tokens_per_step)} a step: "
                          f"{pace.prefill_share:.0%} of its turn{free}")]


def _throughput_lines(plan: Plan) -> list[str]:
    t = plan.throughput
    return [
        "Throughput",
        _row("tokens/s per stream", f"{format_number(t.gpu_tokens_per_s)} tokens/s ÷ "
                                    f"{t.streams_per_gpu} streams = "
                                    f"{format_number(t.tokens_per_s_per_stream)} tokens/s"),
        _row("demand", f"{format_number(t.demand_tokens_per_s)} output tokens/s"),
        _row("accelerators needed", f"{t.gpus_needed:,} (⌈{format_number(t.demand_tokens_per_s)}"
                                    f" ÷ {format_number(t.gpu_tokens_per_s)}⌉)"
                                    + (f" in {t.workers_needed:,} workers of "
                                       f"{t.gpus_needed // t.workers_needed}"
                                       if t.gpus_needed != t.workers_needed else "")),
    ]


def _cost_lines(plan: Plan) -> list[str]:
    cost = plan.cost
    if cost is None:
        return ["Cost", _row("(not priced)", "give --cost-per-hour to price the fleet")]
    return [
        f"Cost (at {format_money(cost.cost_per_gpu_hour)} per accelerator-hour)",
        _row("fleet per hour", format_money(cost.fleet_cost_per_hour)),
        _row("per 1M output tokens", f"{format_money(cost.cost_per_million_tokens_fleet)} "
                                     f"(fleet at this demand); "
                                     f"{format_money(cost.cost_per_million_tokens_full_gpu)}"
                                     f" (one accelerator at full rate)"),
    ]


def _what_if_lines(plan: Plan) -> list[str]:
    lines = ["What if"]
    for what_if in plan.kv_dtype_what_ifs:
        counts = " / ".join(f"{fit.conversations_per_gpu:,}" for fit in what_if.contexts)
        contexts = " / ".join(format_number(fit.context_tokens, 0) for fit in what_if.contexts)
        lines.append(_row(f"KV cache in {what_if.kv_dtype}",
                          f"{format_bytes(what_if.kv_bytes_per_token)}/token -> {counts} "
                          f"conversations at {contexts} tokens "
                          f"({format_number(what_if.capacity_factor)}× capacity)"))
    if not plan.kv_dtype_what_ifs:
        lines.append(_row("smaller KV dtype", "already at 1 byte per element"))
    lines.extend(_prefix_lines(plan))
    return lines


def _prefix_lines(plan: Plan) -> list[str]:
    p = plan.prefix_what_if
    lines = [_row("prefix caching",
                  f"{p.prompts:,} prompts × {p.opening_tokens:,}-token shared opening: "
                  f"{p.computations_without_cache:,} -> {p.computations_with_cache:,} prefill "
                  f"token computations ({p.computations_saved:,} saved)")]
    if p.prefix_share is not None:
        lines.append(_row("", f"{p.prefix_share:.0%} of prompt tokens from the cache -> "
                              f"prefill work × {format_number(p.prefill_fraction_left)}"))
    lines.append(_row("", "live KV per conversation is unchanged: conversations per "
                          "accelerator stay the same"))
    return lines


def _warning_lines(plan: Plan) -> list[str]:
    return ["Warnings"] + [f"{_INDENT}- {w}" for w in plan.warnings] if plan.warnings else []


def _row(label: str, value: str) -> str:
    return f"{_INDENT}{label:<22}{value}"
