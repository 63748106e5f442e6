"""benchmarks/http_peers.py over several rounds: medians per system, the ratio of the medians,
and the median of each round's ratio (runs compared within a round, minutes apart, not across
rounds); every failed request counted per system, and the run failed by any."""

from __future__ import annotations

import subprocess
from argparse import Namespace

import pytest

from benchmarks import http_peers
from benchmarks.http_peers import HttpResult, print_table, report_failures, summarize


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
