"""benchmarks/fleet_sim.py's pure parts (benchmarks/fleet_sim_trace.py), without a fleet: the
trace at llm-d's shape, the time-scale arithmetic, one run's row from client records and
heartbeat deltas, the lag verdict, and the tables."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.fleet_sim import kv_tokens, parse_args
from benchmarks.fleet_sim_dynamo import dynamo_python
from benchmarks.fleet_sim_trace import (FIRST_ID, LAST_ID, LLMD_AT_60, LLMD_SUMMARY,
                                        BeatCounters, RunRow, TimeScale, TraceShape, deltas,
                                        generate, lag_share, lag_verdict, poisson_arrivals,
                                        prefixes, published_table, summarise, table,
                                        target_lines, trace_requests, warmup_requests)
from kvfleet.bench.client import BenchTarget, RequestRecord, request_body

SMALL = TraceShape(tenants=6, users=3, prefix_tokens=40, query_tokens=12, output_tokens=5)


def test_the_trace_has_llm_ds_shape_and_is_seeded():
    shape = TraceShape()
    assert (shape.tenants, shape.users, shape.prefix_tokens, shape.query_tokens,
            shape.output_tokens, shape.prompt_tokens) == (150, 5, 6000, 1200, 1000, 7200)
    one = generate(SMALL, rate=20, duration_s=10, seed=3)
    assert one == generate(SMALL, rate=20, duration_s=10, seed=3)
    assert one != generate(SMALL, rate=20, duration_s=10, seed=4)
    assert all(len(r.prompt_token_ids) == 52 for r in one)
    assert all(FIRST_ID <= t < LAST_ID for r in one for t in r.prompt_token_ids)
    assert [r.arrival_s for r in one] == sorted(r.arrival_s for r in one)
    tenant_prefix = prefixes(SMALL, 3)
    for r in one:  # each request: its tenant's shared prefix, then its query
        assert r.prompt_token_ids[:40] == tenant_prefix[r.tenant]
    assert len({r.tenant for r in one}) == SMALL.tenants
    # a new query every request (only the prefix is shared) ...
    assert len({r.prompt_token_ids[40:] for r in one}) == len(one)
    # ... or each user's own, repeated (llm-d's data)
    per_user = generate(TraceShape(**{**SMALL.__dict__, "queries": "per-user"}), 20, 10, 3)
    queries = {(r.tenant, r.user): r.prompt_token_ids[40:] for r in per_user}
    assert all(r.prompt_token_ids[40:] == queries[(r.tenant, r.user)] for r in per_user)
    # another rate: the same tenants' prefixes, new queries
    other = generate(SMALL, rate=5, duration_s=10, seed=3)
    assert {r.prompt_token_ids[:40] for r in other} <= set(tenant_prefix)
    assert not {r.prompt_token_ids[40:] for r in other} & {r.prompt_token_ids[40:] for r in one}
    with pytest.raises(ValueError, match="queries"):
        generate(TraceShape(queries="sometimes"), 1, 1)


def test_the_warm_up_sends_one_request_per_tenant():
    warm = warmup_requests(SMALL, rate=15.0, seed=3)
    assert sorted(r.tenant for r in warm) == list(range(SMALL.tenants))
    assert [r.arrival_s for r in warm] == [i / 15.0 for i in range(SMALL.tenants)]
    tenant_prefix = prefixes(SMALL, 3)
    assert all(r.prompt_token_ids[:40] == tenant_prefix[r.tenant] for r in warm)
    assert warm == warmup_requests(SMALL, rate=15.0, seed=3)


def test_arrivals_are_poisson_at_the_rate():
    times = poisson_arrivals(50.0, 200.0, random.Random(1))
    assert len(times) == pytest.approx(50 * 200, rel=0.05)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.1)  # exponential: sd = mean
    assert all(0 <= t < 200 for t in times)
    with pytest.raises(ValueError):
        poisson_arrivals(0, 10, random.Random(1))


def test_requests_are_token_ids_to_the_completions_endpoint_with_ignore_eos():
    requests = trace_requests(generate(SMALL, 10, 2, 0), SMALL)
    body = request_body(BenchTarget("m", endpoint="completions"), requests[0])
    assert body["prompt"] == list(requests[0].prompt_token_ids) and len(body["prompt"]) == 52
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    # a text trace's requests are unchanged
    text = request_body(BenchTarget("m", endpoint="completions"),
                        trace_requests(generate(SMALL, 10, 2, 0), SMALL)[0].__class__(
                            0.0, "hello", 3))
    assert text["prompt"] == "hello"


def test_time_scale_arithmetic():
    scale = TimeScale(10)
    assert scale.replay_rate == 0.1  # loadgen sends at arrival / rate: 10x later
    assert scale.modelled_s(2.5) == 0.25 and scale.modelled_s(None) is None
    assert scale.modelled_rate(150.0) == 1500.0
    with pytest.raises(ValueError):
        TimeScale(0)


def test_the_lag_verdict_is_invalid_over_five_percent():
    assert lag_verdict(0.05) == "ok" and lag_verdict(0.0) == "ok"
    assert lag_verdict(0.0501) == "INVALID"
    assert lag_verdict(None) == "INVALID"  # no step played: nothing measured
    beats = {"a": BeatCounters(steps=900, lagged=10), "b": BeatCounters(steps=100, lagged=50)}
    assert lag_share(beats) == pytest.approx(0.06)
    assert lag_share({}) is None


def record(index, ttft, gaps, tokens, sent=0.0, prompt=52, error=None) -> RequestRecord:
    offsets = [ttft]
    for gap in gaps:
        offsets.append(offsets[-1] + gap)
    return RequestRecord(index, sent, tokens, sent_at_s=sent, finished_at_s=sent + offsets[-1],
                         done=error is None, error=error, ttft_s=ttft,
                         chunk_offsets_s=offsets, output_tokens=tokens, prompt_tokens=prompt)


def test_a_runs_row_is_scaled_back_to_modelled_time():
    records = [record(0, 1.0, [0.5] * 4, 5, sent=0.0), record(1, 3.0, [0.5] * 4, 5, sent=1.0),
               record(2, 2.0, [1.0] * 4, 5, sent=2.0, prompt=51),
               record(3, 9.0, [], 0, sent=3.0, error="HTTP 503: no")]
    before = {"w0": BeatCounters(10, 0, 100, 1000, 0), "w1": BeatCounters(5, 0, 0, 0, 0)}
    after = {"w0": BeatCounters(110, 2, 160, 1104, 10), "w1": BeatCounters(105, 3, 0, 52, 5)}
    row = summarise("affinity", 30, records, TimeScale(10), deltas(before, after),
                    {"w0": 2, "w1": 1}, num_workers=3, prompt_tokens=52)
    assert (row.sent, row.ok) == (4, 3)
    # 15 tokens from the first send (0 s) to the last answer (8 s): 1.875/s x 10
    assert row.output_tokens_per_s == pytest.approx(18.75)
    assert row.ttft_p50_s == pytest.approx(0.2)  # 2 s / 10
    assert row.itl_p99_s == pytest.approx(0.1, rel=0.02)
    assert row.cached_share == pytest.approx(60 / 156)
    assert row.requests_per_worker == (0, 2)  # the third worker served nothing
    assert row.prompt_tokens_per_worker == (0, 104)
    assert row.lag_share == pytest.approx(5 / 200) and row.verdict == "ok"
    assert row.wrong_prompt_lengths == 1 and row.errors == {"HTTP 503: no": 1}


def test_tables_print_ours_and_llm_ds_labelled_as_theirs():
    rows = [RunRow("affinity", 60, 10, 10, 9000.0, 0.2, 0.5, 0.03, 0.8, (1, 2), (10, 20),
                   0.01, "ok"),
            RunRow("random", 60, 10, 10, 4500.0, 20.0, 50.0, 0.03, 0.1, (1, 2), (10, 20),
                   0.08, "INVALID")]
    lines = table(rows)
    assert "TTFT p90" in lines[0] and "INVALID" in lines[-1] and "80.0%" in lines[2]
    assert target_lines(rows) == [
        "  60 req/s: random/affinity TTFT p90 100.0x (target >= 20x), affinity/random tok/s "
        "2.00x (target >= 1.5x)  [a run is INVALID]"]
    shared = RunRow("shared", 60, 10, 10, 6000.0, 1.0, 1.25, 0.03, 0.3, (1, 2), (10, 20), 0.01,
                    "ok")
    assert target_lines(rows[:1] + [shared]) == [  # item 7's: 3x lower than shared routing
        "  60 req/s: shared/affinity TTFT p90 2.5x (target >= 3x), affinity/shared tok/s 1.50x"]
    peers = [RunRow("dynamo-kv", 60, 10, 10, 8000.0, 0.2, 1.0, 0.03, None, None, None, None,
                    "unchecked"),
             RunRow("dynamo-random", 60, 10, 10, 4000.0, 2.0, 10.0, 0.03, None, None, None,
                    None, "unchecked")]
    assert target_lines(peers) == [
        "  60 req/s: dynamo-random/dynamo-kv TTFT p90 10.0x, dynamo-kv/dynamo-random tok/s "
        "2.00x"]
    assert table(peers)[2].split()[-4:] == ["-", "-", "-", "unchecked"]
    published = "\n".join(published_table())
    assert "THEIRS" in published and "real GPUs" in published
    assert "8,730" in published and "0.54s" in published and "4,429" in published
    assert "92.55s" in published and "10,497" in published  # their 60/s stage too
    assert [r.scheduler for r in LLMD_SUMMARY] == [r.scheduler for r in LLMD_AT_60]


def test_a_peers_row_has_no_heartbeats():
    """Dynamo's rows: the cached share from the answers' usage where reported, no load, no lag
    verdict."""
    records = [record(0, 1.0, [0.5] * 4, 5), record(1, 2.0, [0.5] * 4, 5, sent=1.0)]
    records[0].cached_tokens, records[1].cached_tokens = 40, 0
    row = summarise("dynamo-kv", 10, records, TimeScale(10), None, {}, 8, 52)
    assert row.cached_share == pytest.approx(40 / 104)
    assert (row.requests_per_worker, row.prompt_tokens_per_worker) == (None, None)
    assert (row.lag_share, row.verdict) == (None, "unchecked")
    assert row.ttft_p90_s == pytest.approx(0.19)
    records[0].cached_tokens = 0  # none reported: unknown, not 0%
    assert summarise("dynamo-kv", 10, records, TimeScale(10), None, {}, 8, 52).cached_share \
        is None


def test_the_command_line_and_the_dynamo_peer(tmp_path):
    args = parse_args(["--rates", "3,60", "--routings", "affinity,random"])
    assert args.rates == [3.0, 60.0] and args.routings == ["affinity", "random"]
    assert args.output_tokens == 1000 and args.workers == 8 and args.tensor_parallel == 2
    assert parse_args([]).routings == ["affinity", "shared", "random"]
    assert parse_args(["--dynamo-venv", "x"]).routings == [
        "affinity", "shared", "random", "dynamo-kv", "dynamo-random"]
    with pytest.raises(SystemExit):
        parse_args(["--routings", "round-robin"])
    assert dynamo_python(None) == (None, "no --dynamo-venv given")
    python, why = dynamo_python(str(tmp_path))
    assert python is None and "no virtualenv python" in why
    # the mockers' KV pool: a simulated H100 pair's for Qwen3-32B (~339k tokens; llm-d's vLLM
    # reported 307k a pod)
    assert 300_000 < kv_tokens(args) < 360_000 and kv_tokens(args) % 16 == 0
