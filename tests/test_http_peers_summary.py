"""benchmarks/http_peers.py over several rounds: medians per system, and the median of each
round's ratio (runs compared within a round, minutes apart, not across rounds)."""

from __future__ import annotations

from benchmarks.http_peers import HttpResult, print_table, summarize


def result(name: str, tokens_per_s: float, startup_s: float = 10.0) -> HttpResult:
    return HttpResult(name, startup_s, 6970, 6970 / tokens_per_s, tokens_per_s, 5.0)


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
    # the median of the rounds' ratios, not the ratio of the medians (250 / 200 also 1.25 here)
    assert peer.ratio == 1.25


def test_the_ratio_of_medians_can_differ_from_the_median_ratio():
    rounds = [
        [result("kvfleet, --dtype auto", 300.0), result("vLLM, --dtype bfloat16", 280.0)],
        [result("kvfleet, --dtype auto", 200.0), result("vLLM, --dtype bfloat16", 150.0)],
        [result("kvfleet, --dtype auto", 250.0), result("vLLM, --dtype bfloat16", 260.0)],
    ]
    _, rows = summarize(rounds)
    ours, peer = rows
    assert (ours.tokens_per_s, peer.tokens_per_s) == (250.0, 260.0)  # medians: 0.96x
    assert peer.ratio == 300.0 / 280.0  # rounds: 1.07x, 1.33x, 0.96x


def test_kvfleets_fastest_dtype_is_the_reference(capsys):
    rounds = [[result("kvfleet, --dtype auto", 250.0), result("kvfleet, --dtype float32", 120.0),
               result("vLLM, --dtype bfloat16", 200.0)]] * 2
    best, rows = summarize(rounds)
    assert best == "kvfleet, --dtype auto"
    assert [round(r.ratio, 4) for r in rows] == [1.0, round(250 / 120, 4), 1.25]
    print_table(rounds)
    out = capsys.readouterr().out
    assert "kvfleet, --dtype auto is" in out and "every round's ratio" in out
    assert "| vLLM, --dtype bfloat16 | 10.0 | 6970 | 34.9 | 200.0 | 5.0 | 1.25x | 200.0 / 200.0 | 1.25 / 1.25 |" in out


def test_one_round_prints_the_plain_table(capsys):
    print_table([[result("kvfleet, --dtype auto", 250.0), result("vLLM, --dtype bfloat16", 200.0)]])
    out = capsys.readouterr().out
    assert "every round" not in out and "median" not in out
    assert "| vLLM, --dtype bfloat16 | 10.0 | 6970 | 34.9 | 200.0 | 5.0 | 1.25x |" in out
