"""PNG plots of a benchmark (matplotlib, Agg backend, imported only when plotting): latency CDFs,
output tokens/s over time, and goodput/throughput against load for a sweep."""

from __future__ import annotations

import math
from pathlib import Path

from kvfleet.bench.client import RequestRecord
from kvfleet.bench.stats import Summary

_NUM_TIME_BINS = 60
_DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(records: list[RequestRecord], path: Path) -> Path:
    plt = _pyplot()
    ok = [r for r in records if r.ok]
    series = [("TTFT", [r.ttft_s for r in ok if r.ttft_s is not None]),
              ("ITL (per token)", [gap for r in ok for gap in r.itl_s]),
              ("E2E latency", [r.e2e_s for r in ok if r.e2e_s is not None])]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, (title, values) in zip(axes, series):
        values = sorted(values)
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axis.step(values, fractions, where="post")
        axis.set(title=title, xlabel="seconds", ylabel="fraction of requests" if
                 title == "TTFT" else "", ylim=(0, 1.02))
        axis.grid(alpha=0.3)
    return _save(plt, figure, path)


def output_tokens_over_time(records: list[RequestRecord],
                            duration_s: float) -> tuple[list[float], list[float]]:
    """(bin start seconds, output tokens/s in that bin), each chunk counted at its arrival."""
    bin_s = max(duration_s / _NUM_TIME_BINS, 1e-3)
    num_bins = max(1, math.ceil(duration_s / bin_s))
    tokens = [0.0] * num_bins
    for record in records:
        if record.sent_at_s is None:
            continue
        for offset_s in record.chunk_offsets_s:
            index = min(int((record.sent_at_s + offset_s) / bin_s), num_bins - 1)
            tokens[index] += record.tokens_per_chunk
    return [i * bin_s for i in range(num_bins)], [t / bin_s for t in tokens]


def plot_throughput(records: list[RequestRecord], duration_s: float, path: Path) -> Path:
    plt = _pyplot()
    starts_s, tokens_per_s = output_tokens_over_time(records, duration_s)
    figure, axis = plt.subplots(figsize=(8, 3.8))
    axis.step(starts_s, tokens_per_s, where="post")
    axis.set(title="Output tokens/s over time", xlabel="seconds since start",
             ylabel="output tokens/s")
    axis.grid(alpha=0.3)
    return _save(plt, figure, path)


def plot_sweep(loads: list[float], summaries: list[Summary], sweep_by: str,
               goodput_target: float, path: Path) -> Path:
    plt = _pyplot()
    figure, (goodput_axis, tokens_axis) = plt.subplots(1, 2, figsize=(11, 3.8))
    goodput_axis.plot(loads, [s.goodput_fraction for s in summaries], marker="o")
    goodput_axis.axhline(goodput_target, color="red", linestyle="--", label="target")
    goodput_axis.set(title="SLO goodput", xlabel=sweep_by, ylabel="fraction of requests",
                     ylim=(0, 1.05), xscale="log")
    goodput_axis.legend()
    tokens_axis.plot(loads, [s.tokens_per_s_per_accelerator for s in summaries], marker="o")
    tokens_axis.set(title="Output tokens/s per accelerator", xlabel=sweep_by, xscale="log")
    for axis in (goodput_axis, tokens_axis):
        axis.set_xticks(loads, labels=[f"{load:g}" for load in loads])
        axis.minorticks_off()
        axis.grid(alpha=0.3)
    return _save(plt, figure, path)


def _save(plt, figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=_DPI)
    plt.close(figure)
    return path
