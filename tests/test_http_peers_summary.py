"""benchmarks/http_peers.py over several rounds: medians per system, the ratio of the medians,
and the median of each round's ratio (runs compared within a round, minutes apart, not across
rounds); every failed request counted per system, and the run failed by any."""

from __future__ import annotations

import json
import subprocess
from argparse import Namespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import http_peers
from benchmarks.http_peers import HttpResult, print_table, report_failures, summarize
from benchmarks.roofline import ModelCost, ProductRates
from benchmarks.serve_floor import Ceilings, Workload
from kvfleet.shared.model_shapes import shape_config
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path


def result(name: str, tokens_per_s: float, startup_s: float = 10.0,
           errors: int = 0) -> HttpResult:
    return HttpResult(name, startup_s, 6970, 6970 / tokens_per_s, tokens_per_s, 5.0, 64, errors,
                      "HTTP 500: boom" if errors else None)


def test_ratios_are_taken_within_each_round_then_their_median():
    rounds = [
        [result("kvfleet, --dtype auto", 300.0), result("vLLM, --dtype bfloat16", 240.0)],  # 1.25
        [result("kvfleet, --dtype auto", 200.0), result("vLLM, --dtype bfloat16", 190.0)],  # 1.05
        [result("kvfleet, --dtype auto", 250.0), result("vLLM, --dtype bfloat16", 200.0)],  # 1.25
    ]
    best, rows = summarize(rounds)
    assert best == "kvfleet, --dtype auto"
    ours, peer = rows
    assert ours.tokens_per_s == 250.0 and ours.ratio == 1.0
    assert peer.tokens_per_s == 200.0
    assert peer.all_ratios == [1.25, 200.0 / 190.0, 1.25]
    # the median of the rounds' ratios, and the ratio of the medians (250 / 200 also 1.25 here)
    assert peer.ratio == 1.25 and peer.ratio_of_medians == 1.25
    assert (ours.rounds, peer.rounds) == (3, 3)  # as many rounds each


def test_the_ratio_of_medians_can_differ_from_the_median_ratio():
    rounds = [
        [result("kvfleet, --dtype auto", 300.0), result("vLLM, --dtype bfloat16", 280.0)],
        [result("kvfleet, --dtype auto", 200.0), result("vLLM, --dtype bfloat16", 150.0)],
        [result("kvfleet, --dtype auto", 250.0), result("vLLM, --dtype bfloat16", 260.0)],
    ]
    _, rows = summarize(rounds)
    ours, peer = rows
    assert (ours.tokens_per_s, peer.tokens_per_s) == (250.0, 260.0)  # medians: 0.96x
    assert peer.ratio_of_medians == 250.0 / 260.0
    assert peer.ratio == 300.0 / 280.0  # rounds: 1.07x, 1.33x, 0.96x


def test_kvfleets_fastest_dtype_is_the_reference(capsys):
    rounds = [[result("kvfleet, --dtype auto", 250.0), result("kvfleet, --dtype float32", 120.0),
               result("vLLM, --dtype bfloat16", 200.0)]] * 2
    best, rows = summarize(rounds)
    assert best == "kvfleet, --dtype auto"
    assert [round(r.ratio, 4) for r in rows] == [1.0, round(250 / 120, 4), 1.25]
    print_table(rounds)
    out = capsys.readouterr().out
    assert "kvfleet, --dtype auto is (ratio of medians) | median of the rounds' ratios" in out
    assert "every round's ratio" in out
    assert ("| vLLM, --dtype bfloat16 | 10.0 | 6970 | 34.9 | 200.0 | 5.0 | 0 of 128 | 1.25x | "
            "1.25x | 200.0 / 200.0 | 1.25 / 1.25 |") in out


def test_one_round_prints_the_plain_table(capsys):
    print_table([[result("kvfleet, --dtype auto", 250.0), result("vLLM, --dtype bfloat16", 200.0)]])
    out = capsys.readouterr().out
    assert "every round" not in out and "median" not in out
    assert "| vLLM, --dtype bfloat16 | 10.0 | 6970 | 34.9 | 200.0 | 5.0 | 0 of 64 | 1.25x |" in out


def test_failed_requests_are_counted_per_system_and_fail_the_run(capsys):
    rounds = [[result("kvfleet, --dtype auto", 250.0), result("vLLM, --dtype bfloat16", 200.0)],
              [result("kvfleet, --dtype auto", 240.0),
               result("vLLM, --dtype bfloat16", 190.0, errors=3)]]
    _, (ours, peer) = summarize(rounds)
    assert (ours.num_errors, ours.num_requests) == (0, 128)
    assert (peer.num_errors, peer.num_requests) == (3, 128)
    print_table(rounds)
    assert report_failures(rounds) == 1
    out = capsys.readouterr().out
    assert "| 3 of 128 |" in out
    assert "FAILED: vLLM, --dtype bfloat16: 3 of 64 requests failed (HTTP 500: boom)" in out
    assert report_failures([[result("kvfleet, --dtype auto", 250.0)]]) == 0


@pytest.mark.parametrize("code, written, raises", [(0, True, False), (1, True, False),
                                                   (2, False, True), (1, False, True)])
def test_the_client_exiting_1_on_failed_requests_still_gives_its_summary(
        monkeypatch, tmp_path, code, written, raises):
    """`kvfleet bench` exits 1 when any request failed, its results.json written: the summary
    (with its errors) is read; any other exit, or no results, stops the run."""
    stale = tmp_path / "results.json"
    stale.write_text('{"summary": {"stale": true}}')

    def fake_run(command, **kwargs):
        if written:
            stale.write_text('{"summary": {"num_errors": 2}}')
        return subprocess.CompletedProcess(command, code)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = Namespace(workload="w.jsonl", num_requests=4, concurrency=0, model="m")
    if raises:
        with pytest.raises(RuntimeError, match=f"exited with code {code}"):
            http_peers.run_client("http://x", args, tmp_path)
    else:
        assert http_peers.run_client("http://x", args, tmp_path) == {"num_errors": 2}


def test_the_trace_is_counted_as_the_client_sends_it():
    args = Namespace(workload=http_peers.WORKLOAD, num_requests=5, concurrency=0)
    workload = http_peers.trace_workload(args, resolve_model_path(DEFAULT_MODEL))
    rows = [json.loads(line) for line in open(http_peers.WORKLOAD)][:5]
    assert workload.output_lengths == tuple(r["max_tokens"] for r in rows)
    assert workload.concurrency == 5 and workload.cached == (0,) * 5
    # a prompt's tokens: a few characters each, never more tokens than characters
    assert all(len(r["prompt"]) / 8 < n <= len(r["prompt"])
               for r, n in zip(rows, workload.prompt_lengths))
    args.concurrency = 2
    assert http_peers.trace_workload(args, resolve_model_path(DEFAULT_MODEL)).concurrency == 2


def test_each_system_is_placed_under_the_traces_ceiling():
    workload = Workload((100,) * 4, (50,) * 4, (0,) * 4, 4)
    with torch.device("meta"):
        cost = ModelCost.of(AutoModelForCausalLM.from_config(shape_config("llama-3.2-1b")))
    # a peak that makes the floor 2 s: a ceiling of 100 output tok/s
    rates = ProductRates(torch.bfloat16, 512, 2048, 8192, {"oneDNN": workload.flops(cost) / 2},
                         "AVX512")
    ceilings = Ceilings(cost, (rates,), bandwidth=1e15)
    rounds = [[result("kvfleet, --dtype auto", 80.0), result("vLLM, --dtype bfloat16", 60.0)],
              [result("kvfleet, --dtype auto", 70.0), result("vLLM, --dtype bfloat16", 50.0)]]
    lines = http_peers.floor_lines(rounds, ceilings, workload)
    assert "ceiling 100.0 output tok/s" in lines[0]
    assert "  kvfleet, --dtype auto: 75% of the ceiling" in lines  # median of 80 and 70
    assert "  vLLM, --dtype bfloat16: 55% of the ceiling" in lines
    assert lines[-1].endswith("82% of the ceiling: within it")  # 1.5 x 55%
    faster_peer = [[result("vLLM, --dtype bfloat16", 70.0)]]
    assert http_peers.floor_lines(faster_peer, ceilings, workload)[-1].endswith(
        "beyond this machine")
