"""benchmarks/kv_tiers.py's arithmetic (case (c)'s prefix capped to the model's context, its pool
sized for the requests and one copy of the prefix, the peer ratio, the verdicts, each part's
command line) and a smoke run of the peer part and case (c) on the tiny random Llama saved as a
model directory (its context of 512 caps case (c)'s prefix)."""

from __future__ import annotations

import json
import shlex

import pytest

from benchmarks.kv_tiers import (
    PART_FLAGS, PEER_TARGET, SHARED_TARGET, main, parse_args, part_command, peer_ratio,
    shared_pool_blocks, shared_prefix_length, verdict)
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
