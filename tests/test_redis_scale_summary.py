"""benchmarks/redis_scale.py over several rounds: medians per topology, the median of each
round's ratio to the single Redis (and of the cluster to three single Redis servers side by
side), and the machine readings a row carries."""

from __future__ import annotations

import pytest

from benchmarks.redis_scale import format_summary, machine_busy_pct, machine_cpu, summarize


def row(topology: str, us_per_event: float, events_per_s: int = 3000, errors: int = 0) -> dict:
    return {"topology": topology, "redis_cpu_us_per_event": us_per_event,
            "events_per_s": events_per_s, "errors": errors}


def test_ratios_are_taken_within_each_round_then_their_median():
    rounds = [[row("single", 10.0), row("cluster", 12.0), row("singles3", 11.0)],   # 1.2
              [row("single", 20.0), row("cluster", 21.0), row("singles3", 20.0)],   # 1.05
              [row("single", 15.0), row("cluster", 30.0, errors=1), row("singles3", 15.0)]]  # 2
    summary = summarize(rounds)
    cluster = summary["topologies"]["cluster"]
    assert cluster["ratio_to_single"] == [1.2, 1.05, 2.0]
    assert cluster["median_ratio_to_single"] == 1.2
    # the median of the rounds' ratios, not the ratio of the medians (21 / 15 = 1.4)
    assert cluster["median_redis_cpu_us_per_event"] == 21.0
    assert cluster["errors"] == 1
    assert summary["topologies"]["single"]["median_ratio_to_single"] == 1.0
    assert summary["cluster_to_singles3"] == [round(12 / 11, 3), 1.05, 2.0]
    assert summary["median_cluster_to_singles3"] == round(12 / 11, 3)
    text = format_summary(summary, 3)
    assert "cluster / single Redis CPU per event: 1.200 (median of the rounds)" in text
    assert "cluster / singles3: 1.091" in text


def test_without_the_diagnostic_there_is_no_cluster_to_singles3_ratio():
    summary = summarize([[row("single", 8.0), row("cluster", 10.0)]])
    assert "median_cluster_to_singles3" not in summary
    assert summary["topologies"]["cluster"]["median_ratio_to_single"] == 1.25
    assert format_summary(summary, 1).endswith("cluster / single Redis CPU per event: 1.250")


def test_machine_busy_share_comes_from_two_proc_stat_readings():
    assert machine_busy_pct((100, 1000), (175, 1100)) == 75.0
    assert machine_busy_pct((5, 5), (5, 5)) == 0.0  # no time passed: no division by zero
    busy, total = machine_cpu()
    assert 0 <= busy <= total and total > 0


@pytest.mark.parametrize("flags", [["--three-singles"], ["--repeats", "0"]])
def test_bad_flag_combinations_are_refused_before_any_server_starts(flags, monkeypatch, capsys):
    from benchmarks import redis_scale

    monkeypatch.setattr("sys.argv", ["redis_scale", *flags])
    with pytest.raises(SystemExit) as exit_info:
        redis_scale.main()
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err
