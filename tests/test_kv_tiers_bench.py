"""benchmarks/kv_tiers.py's arithmetic (case (c)'s prefix capped to the model's context, its pool
sized for the requests and one copy of the prefix, the peer ratio, the verdicts, each part's
command line, the soak's verdicts over samples) and smoke runs of the peer part and case (c), and
of a few seconds' soak, on the tiny random Llama saved as a model directory (its context of 512
caps case (c)'s prefix)."""

from __future__ import annotations

import json
import shlex

import pytest

from benchmarks.kv_peer_fetch import PEER_TARGET, peer_ratio
from benchmarks.kv_shared_prefix import SHARED_TARGET, shared_pool_blocks, shared_prefix_length
from benchmarks.kv_soak import (
    MIB, SoakSample, baseline_index, leak_bounds, no_leak, pool_within_budget, soak_verdicts,
    tier_churned, tier_within_budget)
from benchmarks.kv_tiers import PART_FLAGS, SOAK_FLAGS, main, parse_args, part_command
from benchmarks.kv_tiers_common import verdict
from tests.engine.tiny_models import save_tiny_llama


def test_the_shared_prefix_is_capped_to_what_fits_the_models_context():
    # 8,192 less a 16-token question and 8 output tokens
    assert shared_prefix_length(10000, 8192, 16, 8) == (8168, True)
    assert shared_prefix_length(8168, 8192, 16, 8) == (8168, False)  # exactly fits
    assert shared_prefix_length(2000, 8192, 16, 8) == (2000, False)
    assert shared_prefix_length(10000, 32768, 16, 8) == (10000, False)
    with pytest.raises(ValueError, match="no room"):
        shared_prefix_length(100, 24, 16, 8)


@pytest.mark.parametrize("prefix, block_size", [(128, 16), (10000, 64), (8168, 16), (488, 16)])
def test_the_shared_pool_holds_the_requests_own_blocks_and_one_copy_of_the_prefix(prefix,
                                                                                   block_size):
    requests, question, max_tokens = 50, 16, 8
    blocks = shared_pool_blocks(prefix, question, max_tokens, requests, block_size)
    shared = prefix // block_size
    own = -(-(prefix + question + max_tokens) // block_size) - shared
    # beside the scheduler's watermark (1% kept free when others run), with one block to spare
    assert blocks - int(0.01 * blocks) >= shared + requests * own + 1
    assert blocks < shared + requests * own + 0.02 * blocks + 3  # not much more: one copy
    # 128 tokens = 8 full blocks of 16; each request's 24 more tokens (and none of the prefix's:
    # it ends on a block boundary) take 2 blocks: 8 + 4 * 2 = 16, 17 beside the watermark, +1
    assert shared_pool_blocks(128, 16, 8, 4, 16) == 18
    # 10,000 = 156 blocks of 64 and 16 tokens, the rest of that block each request's own
    assert shared_pool_blocks(10000, 16, 8, 50, 64) == -(-(156 + 50) * 100 // 99) + 1


def test_the_peer_ratio_and_the_verdicts():
    # recomputing: 1 s to the first token; fetching: 50 ms, then 150 ms to it: 5x
    assert peer_ratio(1.0, 0.05, 0.15) == pytest.approx(5.0)
    assert verdict(peer_ratio(1.0, 0.05, 0.15) + 1e-9, PEER_TARGET) == "MET"
    assert verdict(peer_ratio(1.0, 0.10, 0.15), PEER_TARGET) == "MISSED"  # 4x
    assert verdict(0.95, SHARED_TARGET) == "MET"
    assert verdict(0.949, SHARED_TARGET) == "MISSED"
    assert verdict(1.2, SHARED_TARGET) == "MET"  # the tier may be no slower at all


def test_the_defaults_are_the_issues_figures():
    args = parse_args([])
    assert (args.long_prefix_tokens, args.shared_prefix_tokens, args.shared_requests) == (
        2000, 10000, 50)
    assert not (args.skip_working_set or args.skip_long_prefix or args.skip_peer
                or args.skip_shared)


@pytest.mark.parametrize("part", list(PART_FLAGS))
def test_each_parts_command_runs_it_alone_with_the_same_figures(part):
    args = parse_args(["--model", "/models/tiny", "--threads", "3", "--repeats", "5",
                       "--long-prefix-tokens", "500", "--shared-prefix-tokens", "700",
                       "--shared-requests", "7", "--prefix-tokens", "300", "--seed", "4"])
    words = shlex.split(part_command(args, part))
    assert words[:3] == [".venv/bin/python", "-m", "benchmarks.kv_tiers"]
    again = parse_args(words[3:])
    skipped = {name for name in PART_FLAGS if getattr(again, "skip_" + name)}
    assert skipped == set(PART_FLAGS) - {part}
    for name in (*PART_FLAGS[part], "model", "threads", "repeats", "seed", "dtype"):
        assert getattr(again, name) == getattr(args, name), name
    assert "--dtype" not in words  # the default is left out
    assert "--model" not in shlex.split(part_command(parse_args([]), part))


def test_the_peer_part_and_case_c_run_on_a_tiny_model(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "kv_tiers.json"
    # two repeats: the recomputing engine runs after the fetching one, then before it
    assert main(["--model", model, "--dtype", "float32", "--skip-working-set",
                 "--skip-long-prefix", "--long-prefix-tokens", "64", "--shared-requests", "4",
                 "--repeats", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert set(results) == {"args", "peer", "shared"}

    peer = results["peer"]
    assert peer["answers_match"] is True
    assert peer["target"] == PEER_TARGET and peer["verdict"] in ("MET", "MISSED")
    assert peer["verdict"] == verdict(peer["ratio"], PEER_TARGET)
    for name in ("fetch_s", "bytes", "mb_per_s", "ttft_after_fetch_s", "fetch_plus_ttft_s",
                 "recompute_ttft_s"):
        assert peer["median"][name] > 0, name
    assert len(peer["runs"]) == 2
    for run in peer["runs"]:  # 64 tokens: 4 blocks of 16, every one found installed
        assert run["blocks"] == 4 and run["peer_hit_tokens"] == 64 and run["answers_match"]
        assert run["bytes"] > run["payload_bytes"] > 0
    assert peer["command"] in printed and "--skip-peer" not in peer["command"]

    shared = results["shared"]
    # the tiny model's context is 512: 10,000 capped to 512 - 16 - 8, and said so
    assert (shared["prefix_tokens"], shared["capped"], shared["max_model_len"]) == (488, True, 512)
    assert "capped from 10,000" in printed
    assert shared["identical"] is True
    assert shared["verdict"] == verdict(shared["ratio"], SHARED_TARGET)
    assert shared["ratio"] == pytest.approx(shared["median"]["host"]["tokens_per_s"]
                                            / shared["median"]["device"]["tokens_per_s"])
    prefix_blocks = shared["prefix_blocks"]
    assert prefix_blocks == 488 // 16
    for label, expect_restored in (("device", 0), ("host", prefix_blocks)):
        assert len(shared["runs"][label]) == 2
        for run in shared["runs"][label]:
            assert run["output_tokens"] == 4 * 8 and len(run["ttft_s"]) == 4
            # the prefix found by every request, from the tier once (not once a request)
            assert run["hit_tokens"] == 4 * prefix_blocks * 16
            assert run["restored_blocks"] == expect_restored
            assert run["host_hit_tokens"] == expect_restored * 16
            assert (run["pushed_by"] > 0) == (label == "host")
    assert "RATIO throughput host/device" in printed


# ---- the soak ----------------------------------------------------------------------------------


def soak_sample(t_s: float, rss_mib: float = 1000.0, objects: int = 500_000, *,
                tier_used: int = 12, tier_capacity: int = 12, pool_free: int = 100,
                offloaded: int = 0, evicted: int = 0, restored: int = 0,
                invariants: str = "") -> SoakSample:
    """A sample `t_s` into a soak (tier sizes in MiB), a request a second."""
    return SoakSample(t_s, int(t_s), int(rss_mib * MIB), objects, 128, pool_free, 90,
                      tier_used * MIB, tier_capacity * MIB, offloaded, evicted, restored,
                      invariants)


def test_the_leak_check_passes_on_a_flat_process_and_fails_on_a_growing_one():
    flat = [soak_sample(t, 1000 + (t % 20) / 10, 500_000 + t % 7) for t in range(0, 300, 10)]
    assert all(c.ok for c in no_leak(flat, 2))
    # the bounds: max(64 MiB, 2% of the first RSS after warm-up); 5% of its objects + 10,000
    assert leak_bounds(flat[2]) == (64 * MIB, 35_000)
    assert leak_bounds(soak_sample(0, 10_000, 1_000_000)) == (int(0.02 * 10_000 * MIB), 60_000)
    # RSS up by 0.5 MiB a sample from the baseline on: 13.5 MiB by the end, under the bound;
    # 3 MiB a sample: 81 MiB, over it
    for per_sample, ok in ((0.5, True), (3.0, False)):
        growing = [soak_sample(t, 1000 + per_sample * max(0, t // 10 - 2)) for t in range(0, 300,
                                                                                           10)]
        rss, objects = no_leak(growing, 2)
        assert (rss.name, rss.ok, objects.ok) == ("no RSS leak", ok, True), rss.detail
    # objects: 1,000 more every sample (27,000 by the end) pass; 2,000 (54,000) do not
    for per_sample, ok in ((1000, True), (2000, False)):
        growing = [soak_sample(t, objects=500_000 + per_sample * max(0, t // 10 - 2))
                   for t in range(0, 300, 10)]
        rss, objects = no_leak(growing, 2)
        assert (rss.ok, objects.name, objects.ok) == (True, "no object leak", ok), objects.detail
    # what happened before the baseline (warm-up: the tiers filling) does not count
    warming = [soak_sample(t, 200 if t < 20 else 1000) for t in range(0, 300, 10)]
    assert all(c.ok for c in no_leak(warming, 2))
    assert not all(c.ok for c in no_leak(warming, 0))


def test_the_leak_baseline_is_a_sample_interval_after_the_first_pass():
    samples = [soak_sample(t) for t in range(0, 100, 10)]
    assert baseline_index(samples, 25.0, 10.0) == 4  # the first at or after 35 s: 40 s
    assert baseline_index(samples, 30.0, 10.0) == 4
    assert baseline_index(samples, None, 10.0) is None  # the first pass never ended
    assert baseline_index(samples, 85.0, 10.0) is None
    # too short: no baseline, or nothing after it: both leak checks fail, saying so
    for base in (None, len(samples) - 1):
        checks = no_leak(samples, base)
        assert [c.ok for c in checks] == [False, False]
        assert "too short" in checks[0].detail


def test_the_tier_and_pool_budget_checks():
    within = [soak_sample(t, tier_used=min(t, 12)) for t in range(0, 60, 10)]
    assert tier_within_budget(within).ok
    over = within + [soak_sample(60, tier_used=13)]
    check = tier_within_budget(over)
    assert not check.ok and "over its capacity at 1 samples, first at 60 s" in check.detail
    # no tier at all is not within a budget: the soak runs with one
    assert not tier_within_budget([soak_sample(0, tier_used=0, tier_capacity=0)]).ok

    assert pool_within_budget(within).ok
    assert not pool_within_budget(within + [soak_sample(60, pool_free=129)]).ok
    broken = pool_within_budget(within + [soak_sample(60, invariants="refs disagree")])
    assert not broken.ok and "first broken at 60 s: refs disagree" in broken.detail


def test_the_tier_must_churn():
    assert tier_churned([soak_sample(0), soak_sample(10, offloaded=50, evicted=20,
                                                     restored=5)]).ok
    assert not tier_churned([soak_sample(10, offloaded=50, evicted=0, restored=5)]).ok  # room
    assert not tier_churned([soak_sample(10, offloaded=50, evicted=20, restored=0)]).ok  # unused
    samples = [soak_sample(t, offloaded=t, evicted=t, restored=t) for t in range(0, 60, 10)]
    assert [c.ok for c in soak_verdicts(samples, 5.0, 10.0)] == [True] * 5
    assert [c.ok for c in soak_verdicts([], 5.0, 10.0)] == [False]


def test_the_soaks_command_runs_it_alone_with_the_same_figures():
    args = parse_args(["--model", "/models/tiny", "--soak-minutes", "0.25", "--soak-sample-s", "5",
                       "--soak-tier-fraction", "0.4", "--tenants", "6", "--prefix-tokens", "300",
                       "--seed", "4", "--repeats", "5"])
    words = shlex.split(part_command(args, "soak"))
    again = parse_args(words[3:])
    assert all(getattr(again, "skip_" + name) for name in PART_FLAGS)
    for name in (*SOAK_FLAGS, "model", "seed"):
        assert getattr(again, name) == getattr(args, name), name
    assert "--repeats" not in words  # the soak has none
    # the other parts' commands leave the soak out (its default: none)
    assert parse_args(shlex.split(part_command(args, "peer"))[3:]).soak_minutes == 0
    assert parse_args([]).soak_minutes == 0 and parse_args([]).soak_sample_s == 30
    with pytest.raises(SystemExit):
        parse_args(["--soak-sample-s", "0"])


def test_a_short_soak_runs_on_a_tiny_model(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "kv_tiers.json"
    # 8 tenants x 128 tokens: a pool of 16 blocks (a request takes 10), a tier of 32
    assert main(["--model", model, "--dtype", "float32", "--skip-working-set",
                 "--skip-long-prefix", "--skip-peer", "--skip-shared", "--prefix-tokens", "128",
                 "--soak-minutes", "0.1", "--soak-sample-s", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert set(results) == {"args", "soak"}
    soak = results["soak"]
    assert (soak["num_blocks"], soak["tier_blocks"], soak["tier_fraction"]) == (16, 32, 0.5)
    assert soak["ok"] is True
    assert [v["ok"] for v in soak["verdicts"]] == [True] * 5, soak["verdicts"]
    assert len(soak["samples"]) >= 4 and soak["baseline_index"] is not None
    last = soak["samples"][-1]
    assert last["t_s"] >= 6 and last["requests"] == soak["requests"] > 8
    assert last["tier_used_bytes"] == last["tier_capacity_bytes"] > 0  # full, not over
    assert last["evicted"] > 0 and last["restored"] > 0
    assert all(s["invariants"] == "" for s in soak["samples"])
    assert soak["command"] in printed and "SOAK verdict: PASS" in printed
    assert "SOAK no RSS leak: PASS" in printed
