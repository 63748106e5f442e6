"""Benchmark output an operator reads: a text table of one run's `Summary`, a table of a load
sweep, and the JSON files (`results.json`: summary + per-request records; `sweep.json`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from kvfleet.bench.client import RequestRecord
from kvfleet.bench.stats import Distribution, Summary
from kvfleet.text.units import format_money, format_number, format_seconds

_INDENT = "  "
_ROUND_DIGITS = 6


def record_to_json(record: RequestRecord) -> dict:
    document = asdict(record)
    del document["content"]  # the answers' text is not stored: results.json holds timings
    document["chunk_offsets_s"] = [round(v, _ROUND_DIGITS) for v in record.chunk_offsets_s]
    # Per-token ITLs are not stored: they are the chunk offsets' gaps ÷ tokens_per_chunk.
    document.update(ok=record.ok, tokens_per_chunk=record.tokens_per_chunk,
                    tokens_per_s=record.tokens_per_s)
    return document


def write_results(out_dir: Path, summary: Summary, records: list[RequestRecord],
                  run_info: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    head = json.dumps({"run": run_info, "summary": asdict(summary)}, indent=1)
    # One request per line: the file stays small and greppable, and is still one JSON document.
    requests = ",\n".join(json.dumps(record_to_json(r)) for r in records)
    path.write_text(f'{head[:-1].rstrip()},\n"requests": [\n{requests}\n]}}\n',
                    encoding="utf-8")
    return path


def write_sweep(out_dir: Path, summaries: list[Summary], loads: list[float], sweep_by: str,
                best_load: float | None, run_info: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "sweep.json"
    document = {"run": run_info, "sweep_by": sweep_by, "best_load": best_load,
                "loads": [{"load": load, "summary": asdict(summary)}
                          for load, summary in zip(loads, summaries)]}
    path.write_text(json.dumps(document, indent=1), encoding="utf-8")
    return path


def summary_to_text(summary: Summary) -> str:
    lines = [f"Load: {summary.load}; {summary.num_requests} requests sent, {summary.num_ok} ok, "
             f"{summary.num_errors} failed, in {format_number(summary.duration_s)} s"]
    lines += _four_numbers(summary) + [""] + _latency_table(summary) + [""] + _goodput(summary)
    lines += _error_lines(summary)
    return "\n".join(lines) + "\n"


def _four_numbers(s: Summary) -> list[str]:
    cost = format_money(s.cost_per_million_output_tokens) if s.cost_per_hour is not None \
        else "- (give --cost-per-hour)"
    return [
        _row("time to first token", f"mean {format_seconds(s.ttft_s.mean)}, "
                                    f"p99 {format_seconds(s.ttft_s.p99)}"),
        _row("tokens/s per stream", f"mean {format_number(s.tokens_per_s_per_stream.mean, 1)}, "
                                    f"slowest {format_number(s.tokens_per_s_per_stream.min, 1)}"),
        _row("tokens/s per accel.", f"{format_number(s.tokens_per_s_per_accelerator, 1)} "
                                    f"({format_number(s.output_tokens_per_s, 1)} total ÷ "
                                    f"{s.num_workers} workers)"),
        _row("cost per 1M output", cost),
        _row("request throughput", f"{format_number(s.requests_per_s, 2)} requests/s, "
                                   f"{s.total_output_tokens:,} output tokens"),
    ]


def _latency_table(s: Summary) -> list[str]:
    header = f"{_INDENT}{'':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"
    rows = [("TTFT", s.ttft_s, format_seconds), ("ITL (per token)", s.itl_s, format_seconds),
            ("E2E latency", s.e2e_s, format_seconds),
            ("tokens/s per stream", s.tokens_per_s_per_stream, _one_decimal)]
    return [header] + [_distribution_row(label, d, fmt) for label, d, fmt in rows]


def _distribution_row(label: str, d: Distribution, fmt) -> str:
    cells = "".join(f"{fmt(v):>10}" for v in (d.mean, d.p50, d.p90, d.p99))
    return f"{_INDENT}{label:<22}{cells}"


def _goodput(s: Summary) -> list[str]:
    return [_row("goodput", f"{s.goodput_fraction:.1%} of requests met the SLO "
                            f"({s.num_good}/{s.num_requests}; TTFT <= "
                            f"{format_seconds(s.slo.ttft_s)}, >= "
                            f"{format_number(s.slo.tokens_per_s)} tokens/s per stream), "
                            f"{format_number(s.goodput_requests_per_s, 2)} good requests/s")]


def _error_lines(s: Summary) -> list[str]:
    lines = [_row("errors", f"{count} × {message}") for message, count in s.errors.items()]
    if s.num_without_usage:
        lines.append(_row("note", f"{s.num_without_usage} responses had no usage; their tokens "
                                  f"were counted as content chunks"))
    return lines


def sweep_to_text(summaries: list[Summary], loads: list[float], sweep_by: str,
                  best_load: float | None, goodput_target: float) -> str:
    header = (f"{_INDENT}{sweep_by:>12}{'sent':>6}{'ok':>6}{'goodput':>9}{'tok/s':>10}"
              f"{'tok/s/acc':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'stream p50':>12}")
    lines = [f"Sweep by {sweep_by} (target goodput {goodput_target:.0%})", header]
    for load, s in zip(loads, summaries):
        lines.append(f"{_INDENT}{load:>12g}{s.num_requests:>6}{s.num_ok:>6}"
                     f"{s.goodput_fraction:>9.1%}{format_number(s.output_tokens_per_s, 1):>10}"
                     f"{format_number(s.tokens_per_s_per_accelerator, 1):>11}"
                     f"{format_seconds(s.ttft_s.p50):>10}{format_seconds(s.ttft_s.p99):>10}"
                     f"{_one_decimal(s.tokens_per_s_per_stream.p50):>12}")
    verdict = (f"largest {sweep_by} that meets the SLO: {best_load:g}" if best_load is not None
               else f"no {sweep_by} tried met the SLO goodput of {goodput_target:.0%}")
    return "\n".join(lines + ["", verdict]) + "\n"


def speculation_line(speculation: dict | None) -> str:
    """The run's speculative decoding, as the fleet's workers counted it."""
    if speculation is None:
        return "Speculative decoding: not reported by the server"
    if not speculation["proposed_tokens"]:
        return "Speculative decoding: no tokens proposed (off, or backed off)"
    return (f"Speculative decoding: {speculation['acceptance_rate'] * 100:.1f}% of proposed "
            f"tokens accepted ({speculation['accepted_tokens']:,} of "
            f"{speculation['proposed_tokens']:,})")


def _one_decimal(value: float | None) -> str:
    return format_number(value, 1)


def _row(label: str, value: str) -> str:
    return f"{_INDENT}{label:<22}{value}"
