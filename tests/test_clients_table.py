"""benchmarks/clients.py's reading of the benchmark clients' result files (`vllm bench serve`'s,
GuideLLM's JSON report, AIPerf's profile_export_aiperf.json, kvfleet bench's results.json),
shaped as the real ones (their keys and nesting, with the neighbouring figures a wrong key would
pick up), its agreement check with a negative control, its table, and the offline hub-cache
entry that lets the clients find the tokenizer by the served name."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import clients
from benchmarks.clients import (Figures, Pair, agreement, aiperf_figures, guidellm_figures,
                                hub_home, kvfleet_bench_figures, table, verdicts, vllm_figures)


def distribution(mean: float, median: float, p99: float, total: float = 0.0) -> dict:
    """GuideLLM's distribution summary of a metric."""
    return {"mean": mean, "median": median, "mode": median / 2, "min": 0.0, "max": p99 * 2,
            "count": 32, "total_sum": total,
            "percentiles": {"p50": median, "p95": p99 * 0.9, "p99": p99, "p999": p99 * 1.1}}


def guidellm_doc(tok_s: float, errored: int = 0, incomplete: int = 0) -> dict:
    metric = lambda **kw: {"successful": distribution(**kw), "errored": distribution(0, 0, 0),
                           "incomplete": distribution(0, 0, 0), "total": distribution(**kw)}
    return {"metadata": {}, "config": {}, "benchmarks": [{
        "type_": "generative_benchmark", "duration": 40.0,
        "metrics": {
            "request_totals": {"successful": 32 - errored - incomplete, "errored": errored,
                               "incomplete": incomplete, "total": 32},
            # the mean over the run is total / duration; the median is of per-moment rates
            "output_tokens_per_second": metric(mean=tok_s, median=tok_s / 3, p99=tok_s * 9),
            "time_to_first_token_ms": metric(mean=2500.0, median=2000.0, p99=6000.0),
            "inter_token_latency_ms": metric(mean=110.0, median=100.0, p99=150.0),
            "time_per_output_token_ms": metric(mean=130.0, median=125.0, p99=170.0),
            "prompt_token_count": metric(mean=256.0, median=256.0, p99=256.0, total=8192.0),
            "output_token_count": metric(mean=96.0, median=96.0, p99=96.0, total=3072.0)},
        "requests": {"successful": [], "errored": [{"info": {"error": "HTTP 500"}}] * errored,
                     "incomplete": [], "total": []}}]}


def aiperf_doc(tok_s: float, errors: int = 0) -> dict:
    stat = lambda unit, avg, p50, p99: {"unit": unit, "avg": avg, "p50": p50, "p99": p99,
                                        "p1": p50 / 2, "min": p50 / 3, "max": p99 * 2}
    doc = {"schema_version": "1", "aiperf_version": "0.13.0",
           "request_count": {"unit": "requests", "avg": 32.0},
           "output_token_throughput": {"unit": "tokens/sec", "avg": tok_s},
           "output_token_throughput_per_user": stat("tokens/sec/user", 9.0, 9.5, 12.0),
           "time_to_first_token": stat("ms", 2500.0, 2000.0, 6000.0),
           "time_to_second_token": stat("ms", 120.0, 110.0, 400.0),
           "inter_token_latency": stat("ms", 110.0, 100.0, 150.0),
           "inter_chunk_latency": stat("ms", 111.0, 90.0, 800.0),
           "total_isl": {"unit": "tokens", "avg": 8192.0},
           "total_output_tokens": {"unit": "tokens", "avg": 3065.0},  # its own tokenizer's count
           "total_usage_completion_tokens": {"unit": "tokens", "avg": 3072.0},
           "error_summary": []}
    if errors:
        doc["error_request_count"] = {"unit": "requests", "avg": float(errors)}
        doc["error_summary"] = [{"error_details": {"code": 500, "message": "boom"},
                                 "count": errors}]
    return doc


def vllm_doc(tok_s: float, failed: int = 0) -> dict:
    return {"backend": "openai", "completed": 32 - failed, "failed": failed,
            "total_input_tokens": 8192, "total_output_tokens": 3072,
            "request_throughput": 1.0, "output_throughput": tok_s,
            "total_token_throughput": tok_s * 3.7, "mean_ttft_ms": 2500.0,
            "p50_ttft_ms": 2000.0, "p99_ttft_ms": 6000.0, "mean_tpot_ms": 110.0,
            "p50_tpot_ms": 100.0, "p99_tpot_ms": 150.0, "p50_itl_ms": 90.0, "p99_itl_ms": 800.0,
            "errors": [""] * (32 - failed) + ["Bad Request"] * failed}


def record(ttft_s: float, e2e_s: float, output_tokens: int = 96, ok: bool = True) -> dict:
    return {"sent_at_s": 0.0, "finished_at_s": e2e_s, "status_code": 200 if ok else 500,
            "error": None if ok else "HTTP 500", "done": ok, "ttft_s": ttft_s, "e2e_s": e2e_s,
            "chunk_offsets_s": [], "output_tokens": output_tokens, "prompt_tokens": 256,
            "usage_reported": True, "cached_tokens": 0, "ok": ok}


def kvfleet_bench_doc(tok_s: float, records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    dist = lambda p50, p99: {"count": len(ok), "mean": p50, "min": 0.0, "p50": p50, "p90": p99,
                             "p99": p99, "max": p99}
    return {"run": {}, "summary": {
        "num_requests": len(records), "num_ok": len(ok), "num_errors": len(records) - len(ok),
        "errors": {"HTTP 500": len(records) - len(ok)} if len(ok) < len(records) else {},
        "total_output_tokens": sum(r["output_tokens"] for r in ok), "duration_s": 30.0,
        "output_tokens_per_s": tok_s, "ttft_s": dist(2.0, 6.0), "itl_s": dist(0.09, 0.8)},
        "requests": records}


def test_each_clients_file_gives_its_figures():
    g = guidellm_figures(guidellm_doc(180.0))
    assert (g.client, g.completed, g.failed, g.output_tok_s) == ("GuideLLM", 32, 0, 180.0)
    assert (g.ttft_p50_ms, g.ttft_p99_ms, g.tpot_p50_ms) == (2000.0, 6000.0, 100.0)
    assert (g.input_tokens, g.output_tokens, g.first_error) == (8192, 3072, None)
    a = aiperf_figures(aiperf_doc(181.0))
    assert (a.client, a.completed, a.failed, a.output_tok_s) == ("AIPerf", 32, 0, 181.0)
    assert (a.ttft_p50_ms, a.ttft_p99_ms, a.tpot_p50_ms) == (2000.0, 6000.0, 100.0)
    assert (a.input_tokens, a.output_tokens) == (8192, 3065)  # AIPerf's count, not the usage
    v = vllm_figures(vllm_doc(182.0))
    assert (v.completed, v.failed, v.output_tok_s, v.tpot_p50_ms) == (32, 0, 182.0, 100.0)
    assert (v.input_tokens, v.output_tokens, v.first_error) == (8192, 3072, None)


def test_failed_requests_are_counted_with_the_first_error():
    g = guidellm_figures(guidellm_doc(180.0, errored=2, incomplete=1))
    assert (g.completed, g.failed, g.first_error) == (29, 3, "HTTP 500")
    a = aiperf_figures(aiperf_doc(181.0, errors=3))
    assert (a.completed, a.failed) == (29, 3) and "boom" in a.first_error
    v = vllm_figures(vllm_doc(182.0, failed=1))
    assert (v.completed, v.failed, v.first_error) == (31, 1, "Bad Request")


def test_kvfleet_bench_tpot_is_per_request_from_its_records():
    # (e2e - ttft) / (tokens - 1): 0.1, 0.2 and 0.3 s; the failed request is left out
    records = [record(1.0, 1.0 + 95 * 0.1), record(2.0, 2.0 + 95 * 0.2),
               record(0.5, 0.5 + 95 * 0.3), record(0.1, 0.2, ok=False)]
    k = kvfleet_bench_figures(kvfleet_bench_doc(150.0, records))
    assert (k.client, k.completed, k.failed, k.output_tok_s) == ("kvfleet bench", 3, 1, 150.0)
    assert k.tpot_p50_ms == pytest.approx(200.0)
    assert (k.ttft_p50_ms, k.ttft_p99_ms) == (2000.0, 6000.0)
    assert (k.input_tokens, k.output_tokens, k.first_error) == (768, 288, "HTTP 500")


def figures(client: str, tok_s: float, failed: int = 0) -> Figures:
    return Figures(client, 32 - failed, failed, tok_s, 2000.0, 6000.0, 100.0, 8192, 3072,
                   "HTTP 500" if failed else None)


def test_agreement_within_the_tolerance_and_a_negative_control():
    reference = figures("kvfleet bench", 200.0)
    close = Pair("kvfleet", "random 256/96", figures("GuideLLM", 206.0), reference)
    low = Pair("kvfleet", "random 256/96", figures("AIPerf", 189.0), reference)  # 5.5% apart
    high = Pair("vLLM", "random 256/96", figures("vllm bench serve", 212.0), reference)
    assert close.ratio == pytest.approx(1.03) and close.agrees(0.05)
    assert not low.agrees(0.05) and not high.agrees(0.05) and high.agrees(0.07)
    failed, apart = verdicts([close, low, high], 0.05)
    assert failed == []
    assert [line.split(",")[2].split(":")[0].strip() for line in apart] == [
        "AIPerf", "vllm bench serve"]


def test_the_table_puts_kvfleet_bench_under_each_client_with_the_ratio():
    pairs = [Pair("kvfleet", "random 256/96", figures("GuideLLM", 206.0),
                  figures("kvfleet bench", 200.0)),
             Pair("kvfleet", "random 256/96", figures("AIPerf", 150.0, failed=2),
                  figures("kvfleet bench", 200.0))]
    lines = table(pairs, 0.05)
    assert len(lines) == 2 + 2 * len(pairs)
    client_row, bench_row = lines[2].split("|"), lines[3].split("|")
    assert client_row[3].strip() == "GuideLLM" and client_row[7].strip() == "206.0"
    assert client_row[11].strip() == "1.030 (agrees)"
    assert bench_row[3].strip() == "kvfleet bench" and bench_row[11].strip() == ""
    assert client_row[12].strip() == "-"  # no CPU time measured for these
    assert lines[4].split("|")[11].strip() == "0.750 (**DISAGREES**)"
    failed, apart = verdicts(pairs, 0.05)
    assert len(failed) == 1 and "AIPerf: 2 requests failed (HTTP 500)" in failed[0]
    assert len(apart) == 1


def test_the_served_name_gets_an_offline_hub_cache_entry_without_the_weights(tmp_path,
                                                                              monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (model / name).write_text("{}")
    asked = []
    # the user's own cache does not hold the name; the one made here does
    monkeypatch.setattr(clients, "_in_hub_cache",
                        lambda name, home: asked.append(home) or home is not None)
    env = hub_home("Org/Some-Model", str(model), tmp_path / "hf-home")
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == str(tmp_path / "hf-home")
    entry = tmp_path / "hf-home" / "hub" / "models--Org--Some-Model"
    assert (entry / "refs" / "main").read_text() == "kvfleet-local"
    snapshot = entry / "snapshots" / "kvfleet-local"
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json", "tokenizer.json", "tokenizer_config.json"]
    assert (snapshot / "tokenizer.json").resolve() == (model / "tokenizer.json").resolve()
    assert asked == [None, str(tmp_path / "hf-home")]
    hub_home("Org/Some-Model", str(model), tmp_path / "hf-home")  # again: links replaced


def test_a_name_the_users_cache_holds_is_used_from_there(tmp_path, monkeypatch):
    monkeypatch.setattr(clients, "_in_hub_cache", lambda name, home: home is None)
    env = hub_home("Org/Cached", str(tmp_path), tmp_path / "hf-home")
    assert "HF_HOME" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert not (tmp_path / "hf-home").exists()


def test_over_rounds_the_verdict_is_the_median_ratio():
    def rounds(client: str, *tok_s: float) -> list[Pair]:
        return [Pair("kvfleet", "random 256/96", figures(client, t),
                     figures("kvfleet bench", 100.0), index + 1)
                for index, t in enumerate(tok_s)]

    # one round 8% apart, the median 2%: agrees; the negative control's median is 7% apart
    pairs = rounds("GuideLLM", 108.0, 99.0, 102.0) + rounds("AIPerf", 108.0, 107.0, 99.0)
    lines = agreement(pairs, 0.05)
    guidellm, aiperf = lines[2].split("|"), lines[3].split("|")
    assert [c.strip() for c in guidellm[3:8]] == [
        "GuideLLM", "3", "1.020", "1.080 / 0.990 / 1.020", "agrees"]
    assert [c.strip() for c in aiperf[5:8]] == ["1.070", "1.080 / 1.070 / 0.990", "**DISAGREES**"]
    failed, apart = verdicts(pairs, 0.05)
    assert failed == [] and len(apart) == 1 and "AIPerf" in apart[0] and "1.070" in apart[0]
    assert "GuideLLM (round 2)" in table(pairs, 0.05)[4]


def test_a_clients_cpu_time_is_its_finished_childrens():
    import subprocess
    import sys
    before = clients.children_cpu_s()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert clients.children_cpu_s() - before > 0.05
    row = table([Pair("kvfleet", "w", Figures("GuideLLM", 1, 0, 1.0, 1, 1, 1, 1, 1, None, 12.34),
                      figures("kvfleet bench", 1.0))], 0.05)[2]
    assert row.split("|")[12].strip() == "12.3"


def test_unknown_clients_are_refused():
    with pytest.raises(SystemExit):
        clients.parse_args(["--clients", "vllm-random,locust"])
    with pytest.raises(SystemExit):
        clients.parse_args(["--repeats", "0"])
    args = clients.parse_args([])
    assert args.served == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert args.clients == ["vllm-random", "vllm-prefix", "guidellm", "aiperf"]
    assert clients.parse_args(["--served-model-name", "x/y"]).served == "x/y"
    assert Path(clients.CACHE).name == "kvfleet"


def test_simulated_serves_from_one_simulated_worker_and_no_real_one():
    """`--simulated`: `kvfleet up` as benchmarks.http_peers starts it (`--workers 1`) with the
    simulated worker's arguments after it, so the fleet has no real worker (a real one beside
    the simulated one took half the requests at a quarter of the pace)."""
    from kvfleet.cli import build_parser
    args = clients.parse_args(["--simulated", "--sim-time-scale", "50", "--kvfleet-args=--x 1"])
    up = ["up", "--port", "1", "--dtype", "auto", "--workers", "1", "--model", "m"]
    parsed, rest = build_parser().parse_known_args(up + args.kvfleet_args.split())
    assert (parsed.workers, parsed.sim_workers, parsed.sim_device, parsed.sim_time_scale) == (
        0, 1, "h100", 50.0)
    assert rest == ["--x", "1"]  # the caller's own arguments still reach it
    assert clients.parse_args([]).kvfleet_args == ""  # off by default: the real worker
