"""benchmarks/bench_serve.py's reading of `vllm bench serve`'s result files and its table: medians
over rounds, kvfleet's lead per figure (throughput ours/theirs, latencies theirs/ours), failures
counted."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.bench_serve import FIGURES, floor_lines, table, to_run, workload_args, workload_of
from benchmarks.roofline import ModelCost, ProductRates
from benchmarks.serve_floor import Ceilings
from kvfleet.shared.model_shapes import shape_config


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


def detailed(tok_s: float, input_len: int, output_len: int, n: int = 8) -> dict:
    return result(tok_s, 100.0) | {"completed": n, "failed": 0, "errors": [""] * n,
                                   "input_lens": [input_len] * n, "output_lens": [output_len] * n}


def ceilings_with_ceiling(shape, tokens_per_s: float) -> Ceilings:
    """Ceilings whose floor for `shape` is compute-bound at exactly `tokens_per_s`."""
    with torch.device("meta"):
        cost = ModelCost.of(AutoModelForCausalLM.from_config(shape_config("llama-3.2-1b")))
    seconds = shape.output_tokens / tokens_per_s
    rates = ProductRates(torch.bfloat16, 512, 2048, 8192, {"oneDNN": shape.flops(cost) / seconds},
                         "AVX512")
    return Ceilings(cost, (rates,), bandwidth=1e15)


def test_the_floor_takes_the_requests_the_client_sent_and_places_each_server_under_it():
    runs = [[to_run("kvfleet", "random", detailed(60.0, 256, 64)),
             to_run("vLLM", "random", detailed(50.0, 256, 64))]]
    shape = workload_of(runs[0][0], concurrency=4)
    assert shape.prompt_lengths == (256,) * 8 and shape.output_lengths == (64,) * 8
    assert shape.cached == (0,) * 8 and shape.concurrency == 4
    lines, report = floor_lines(runs, ceilings_with_ceiling(shape, 100.0), concurrency=4)
    assert report["random"]["ceiling_tokens_per_s"] == pytest.approx(100.0)
    assert report["random"]["shares"] == pytest.approx({"kvfleet": 0.6, "vLLM": 0.5})
    assert report["random"]["target_within_ceiling"] is True  # 1.2 x 50% = 60%
    row = next(line for line in lines if line.startswith("| random |"))
    assert "| 60% | 50% | yes |" in row


def test_a_target_beyond_the_ceiling_is_said_so():
    runs = [[to_run("vLLM", "random", detailed(90.0, 256, 64))]]
    shape = workload_of(runs[0][0], concurrency=8)
    lines, report = floor_lines(runs, ceilings_with_ceiling(shape, 100.0), concurrency=8)
    assert report["random"]["target_within_ceiling"] is False
    assert "no: 1.2x vLLM is 108% of the ceiling" in lines[-1]


def test_the_prefix_workload_computes_each_prefix_once():
    run = to_run("kvfleet", "prefix", detailed(1.0, 576, 96, n=6))
    assert workload_of(run, 32).cached == (0, 0, 0, 0, 512, 512)
    assert workload_of(to_run("kvfleet", "random", result(1.0, 1.0)), 32) is None  # no lengths
