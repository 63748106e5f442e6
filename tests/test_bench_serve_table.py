"""benchmarks/bench_serve.py's reading of `vllm bench serve`'s result files and its table: medians
over rounds, kvfleet's lead per figure (throughput ours/theirs, latencies theirs/ours), failures
counted."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.bench_serve import FIGURES, table, to_run, workload_args


def result(tok_s: float, ttft: float, failed: int = 0) -> dict:
    figures = {key: ttft for key, _, _ in FIGURES}
    figures["output_throughput"] = tok_s
    return {**figures, "completed": 48 - failed, "failed": failed,
            "errors": [""] * (48 - failed) + ["HTTP 500"] * failed}


def test_a_result_file_becomes_a_run_with_its_first_error():
    run = to_run("kvfleet", "random", result(120.0, 900.0, failed=2))
    assert run.figures["output_throughput"] == 120.0 and run.figures["p99_itl_ms"] == 900.0
    assert (run.completed, run.failed, run.first_error) == (46, 2, "HTTP 500")
    assert to_run("vLLM", "random", result(1.0, 1.0)).first_error is None


def test_the_table_gives_medians_and_kvfleets_lead_per_figure():
    rounds = [[to_run("kvfleet", "random", result(t, l)), to_run("vLLM", "random", result(100, 1000))]
              for t, l in ((90, 400), (150, 500), (120, 2000))]
    lines = table(rounds)
    ours = next(line for line in lines if line.startswith("| random | kvfleet |"))
    assert "| 3 | 120.0 | 500.0 |" in ours  # medians of (90, 150, 120) and (400, 500, 2000)
    lead = next(line for line in lines if "kvfleet ahead by" in line)
    # 120 / 100 for throughput; 1000 / 500 for a latency
    assert lead.split("|")[4].strip() == "1.20x" and lead.split("|")[5].strip() == "2.00x"


def test_a_round_without_vllm_has_no_ratio_line():
    lines = table([[to_run("kvfleet", "prefix", result(100, 100))]])
    assert not any("ahead by" in line for line in lines)
    assert any(line.startswith("| prefix | kvfleet | 1 |") for line in lines)


def test_the_workloads_are_vllms_datasets():
    args = argparse.Namespace(random_input_len=256, random_output_len=128)
    assert workload_args("random", args)[:2] == ["--dataset-name", "random"]
    assert "prefix_repetition" in workload_args("prefix", args)
    with pytest.raises(SystemExit, match="unknown 'sharegpt'"):
        workload_args("sharegpt", args)
