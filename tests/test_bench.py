"""`kvfleet bench` against a fake OpenAI-compatible streaming server (FastAPI + uvicorn on a free
127.0.0.1 port, in a thread) whose delays are known: the measured TTFT/ITL match them, usage and
files are right, goodput and the sweep follow the SLO, and errors exit with a code, not a trace:
any failed request fails the run (1), its report still written."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, replace

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvfleet.bench import command as bench
from kvfleet.bench.client import BenchTarget, RequestRecord, request_body
from kvfleet.bench.stats import Slo, meets_slo
from kvfleet.bench.trace import load_trace

MODEL = "fake-model"


@dataclass
class Behaviour:
    """How the fake server answers; tests replace fields before running the bench."""

    first_token_delay_s: float = 0.1
    token_delay_s: float = 0.02  # per token; a chunk of k tokens waits k times this
    tokens_per_chunk: int = 1
    delay_per_inflight: bool = False  # token delay × requests in flight (a loaded GPU)
    status_code: int = 200
    num_workers: int | None = 3
    # a kvfleet gateway's /dashboard/data: (proposed, accepted) speculative tokens per request
    # answered, on top of counts from before the run; None: no such route
    spec_per_request: tuple[int, int] | None = None
    failing_prompts: tuple[str, ...] = ()  # these prompts alone are answered HTTP 500


class FakeServer:
    def __init__(self) -> None:
        self.behaviour = Behaviour()
        self.inflight = 0
        self.bodies: list[dict] = []  # every request body received, in order
        self.app = self._make_app()

    def _make_app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": MODEL}]})
        app.get("/health")(lambda: {"status": "ok", "workers": self.behaviour.num_workers})
        app.get("/dashboard/data")(self._dashboard)
        app.post("/v1/chat/completions")(self._handler("chat"))
        app.post("/v1/completions")(self._handler("completions"))
        return app

    def _dashboard(self):
        spec = self.behaviour.spec_per_request
        if spec is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        done = len(self.bodies)
        workers = [{"model": MODEL, "spec_draft_tokens": 1000 + spec[0] * done,
                    "spec_accepted_tokens": 500 + spec[1] * done},
                   {"model": "other-model", "spec_draft_tokens": 7, "spec_accepted_tokens": 7}]
        return {"workers": workers}

    def _handler(self, endpoint: str):
        async def handle(request: Request):
            body = await request.json()
            self.bodies.append(body)
            behaviour = self.behaviour
            if behaviour.status_code != 200:
                return JSONResponse({"error": {"message": "slow down", "type": "rate_limit"}},
                                    status_code=behaviour.status_code)
            if _prompt(body) in behaviour.failing_prompts:
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}},
                                    status_code=500)
            return StreamingResponse(self._events(endpoint, body, behaviour),
                                     media_type="text/event-stream")
        return handle

    async def _events(self, endpoint: str, body: dict, behaviour: Behaviour):
        self.inflight += 1
        try:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(behaviour.first_token_delay_s)
            max_tokens, sent = body["max_tokens"], 0
            while sent < max_tokens:
                if sent:
                    await asyncio.sleep(self._chunk_delay_s(behaviour))
                num_tokens = min(behaviour.tokens_per_chunk, max_tokens - sent)
                sent += num_tokens
                yield _sse(_content_chunk(endpoint, "tok " * num_tokens, sent == max_tokens))
            yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": sent,
                                                 "total_tokens": 7 + sent}})
            yield "data: [DONE]\n\n"
        finally:
            self.inflight -= 1

    def _chunk_delay_s(self, behaviour: Behaviour) -> float:
        scale = self.inflight if behaviour.delay_per_inflight else 1
        return behaviour.token_delay_s * behaviour.tokens_per_chunk * scale


def _prompt(body: dict) -> str:
    return body["prompt"] if "prompt" in body else body["messages"][-1]["content"]


def _content_chunk(endpoint: str, text: str, last: bool) -> dict:
    finish_reason = "length" if last else None
    if endpoint == "chat":
        return {"choices": [{"index": 0, "delta": {"content": text},
                             "finish_reason": finish_reason}]}
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}


def _sse(document: dict) -> str:
    return f"data: {json.dumps(document)}\n\n"


@pytest.fixture(scope="module")
def fake_server():
    server_state = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(server_state.app, log_level="warning", lifespan="off",
                            loop="asyncio", http="h11")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    server_state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield server_state
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake(fake_server):
    fake_server.behaviour = Behaviour()
    return fake_server


def write_trace(path, num_requests: int, max_tokens: int = 5, spacing_s: float = 0.0):
    lines = [json.dumps({"t": i * spacing_s, "prompt": f"question {i}", "max_tokens": max_tokens,
                         "ignore_eos": True}) for i in range(num_requests)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_bench(fake, tmp_path, *extra: str, num_requests: int = 4, max_tokens: int = 5,
              spacing_s: float = 0.0) -> tuple[int, dict]:
    trace = write_trace(tmp_path / "trace.jsonl", num_requests, max_tokens, spacing_s)
    out = tmp_path / "out"
    code = bench.main([trace, "--url", fake.url, "--out", str(out), "--no-progress", *extra])
    results = out / "results.json"
    return code, json.loads(results.read_text()) if results.exists() else {}


def test_measures_ttft_itl_usage_and_writes_files(fake, tmp_path, capsys):
    fake.behaviour = replace(fake.behaviour, first_token_delay_s=0.15, token_delay_s=0.03)
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--cost-per-hour", "2.5",
                              max_tokens=6)
    assert code == 0
    summary, requests = results["summary"], results["requests"]
    assert results["run"]["model"] == MODEL and results["run"]["num_workers_source"] == \
        "GET /health"
    assert summary["num_ok"] == 4 and summary["num_errors"] == 0
    assert [r["output_tokens"] for r in requests] == [6] * 4
    assert all(r["usage_reported"] and r["prompt_tokens"] == 7 for r in requests)
    assert summary["total_output_tokens"] == 24
    assert 0.14 <= summary["ttft_s"]["p50"] <= 0.4
    assert 0.025 <= summary["itl_s"]["p50"] <= 0.08
    assert summary["itl_s"]["count"] == 4 * 5
    assert 12 <= summary["tokens_per_s_per_stream"]["p50"] <= 36  # 1 / 0.03 s
    assert summary["num_workers"] == 3
    assert summary["tokens_per_s_per_accelerator"] == pytest.approx(
        summary["output_tokens_per_s"] / 3)
    assert summary["cost_per_million_output_tokens"] == pytest.approx(
        2.5 * 3 / (summary["output_tokens_per_s"] * 3600) * 1e6)
    for name in ("latency_cdf.png", "throughput.png"):
        png = tmp_path / "out" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    table = capsys.readouterr().out
    assert "time to first token" in table and "goodput" in table and "cost per 1M" in table
    assert results["run"]["speculation"] is None
    assert "Speculative decoding: not reported by the server" in table


def test_reports_the_runs_speculative_acceptance(fake, tmp_path, capsys):
    """Against a kvfleet gateway: the proposed and accepted tokens of this run's model only,
    counted from before the run to after it."""
    fake.bodies.clear()
    fake.behaviour = replace(fake.behaviour, spec_per_request=(10, 6))
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--no-plots")
    assert code == 0
    assert results["run"]["speculation"] == {"proposed_tokens": 40, "accepted_tokens": 24,
                                             "acceptance_rate": 0.6}
    assert "60.0% of proposed tokens accepted (24 of 40)" in capsys.readouterr().out


def test_temperature_is_sent_only_when_given(fake, tmp_path):
    fake.bodies.clear()
    code, _ = run_bench(fake, tmp_path, "--rate", "inf", "--no-plots", "--temperature", "0")
    assert code == 0 and len(fake.bodies) == 4
    assert all(body["temperature"] == 0 and body["ignore_eos"] is True for body in fake.bodies)
    fake.bodies.clear()
    code, _ = run_bench(fake, tmp_path, "--rate", "inf", "--no-plots")
    assert code == 0 and len(fake.bodies) == 4
    assert not any("temperature" in body for body in fake.bodies)


def test_multi_token_chunks_give_per_token_itl(fake, tmp_path):
    fake.behaviour = replace(fake.behaviour, tokens_per_chunk=3, token_delay_s=0.02)
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--endpoint", "completions",
                              "--no-plots", max_tokens=9)
    assert code == 0
    record = results["requests"][0]
    assert record["output_tokens"] == 9 and len(record["chunk_offsets_s"]) == 3
    assert record["tokens_per_chunk"] == 3
    assert 0.015 <= results["summary"]["itl_s"]["p50"] <= 0.05  # 0.06 s gaps ÷ 3 tokens


@pytest.mark.parametrize("behaviour, slo_flags", [
    ({"token_delay_s": 0.1}, ["--slo-tokens-per-s", "20"]),  # 10 tokens/s: too slow a pace
    ({"first_token_delay_s": 0.4}, ["--slo-ttft-s", "0.2"]),  # first token too late
])
def test_a_slow_server_fails_the_slo(fake, tmp_path, behaviour, slo_flags):
    fake.behaviour = replace(fake.behaviour, **behaviour)
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--no-plots", *slo_flags,
                              num_requests=3, max_tokens=3)
    assert code == 0
    assert results["summary"]["num_ok"] == 3
    assert results["summary"]["num_good"] == 0 and results["summary"]["goodput_fraction"] == 0


def test_a_fast_server_meets_the_slo(fake, tmp_path):
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--no-plots",
                              "--slo-ttft-s", "1", "--slo-tokens-per-s", "20")
    assert code == 0 and results["summary"]["goodput_fraction"] == 1.0


def test_rate_scales_arrival_times(fake, tmp_path):
    fake.behaviour = replace(fake.behaviour, first_token_delay_s=0.0, token_delay_s=0.0)
    code, results = run_bench(fake, tmp_path, "--rate", "10", "--no-plots", num_requests=3,
                              max_tokens=2, spacing_s=1.0)
    assert code == 0
    sent_s = [r["sent_at_s"] for r in results["requests"]]
    assert [r["scheduled_at_s"] for r in results["requests"]] == pytest.approx([0, 0.1, 0.2])
    assert sent_s == pytest.approx([0, 0.1, 0.2], abs=0.08)


def test_concurrency_one_is_a_closed_loop(fake, tmp_path):
    code, results = run_bench(fake, tmp_path, "--concurrency", "1", "--num-requests", "3",
                              "--no-plots", num_requests=6, max_tokens=2)
    assert code == 0
    requests = results["requests"]
    assert len(requests) == 3
    for before, after in zip(requests, requests[1:]):
        assert after["sent_at_s"] >= before["finished_at_s"] - 0.005


def test_sweep_stops_where_latency_growth_breaks_the_slo(fake, tmp_path, capsys):
    # Pace = 1 / (0.01 s × in flight): 100, 50, 25 tokens/s pass 16; 8 in flight gives 12.5.
    fake.behaviour = replace(fake.behaviour, first_token_delay_s=0.0, token_delay_s=0.01,
                             delay_per_inflight=True)
    code, _ = run_bench(fake, tmp_path, "--sweep", "--sweep-by", "concurrency",
                        "--sweep-loads", "1,2,4,8,16", "--slo-tokens-per-s", "16",
                        num_requests=8, max_tokens=5)
    assert code == 0
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [step["load"] for step in sweep["loads"]] == [1, 2, 4, 8]
    assert sweep["best_load"] == 4
    assert sweep["loads"][-1]["summary"]["goodput_fraction"] < 0.9
    assert (tmp_path / "out" / "concurrency-4" / "results.json").exists()
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 1000
    assert "largest concurrency that meets the SLO: 4" in capsys.readouterr().out


def test_duration_limit_cancels_running_requests(fake, tmp_path, capsys):
    fake.behaviour = replace(fake.behaviour, token_delay_s=0.2)
    started = time.perf_counter()
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--duration-limit", "0.4",
                              "--no-plots", num_requests=2, max_tokens=50)
    assert time.perf_counter() - started < 3
    assert code == 1  # every request failed
    assert {r["error"] for r in results["requests"]} == {"cancelled at the duration limit"}
    assert "every request failed" in capsys.readouterr().err


def test_one_failed_request_fails_the_run_and_keeps_the_report(fake, tmp_path, capsys):
    fake.behaviour = replace(fake.behaviour, failing_prompts=("question 2",))
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--no-plots", num_requests=4)
    assert code == 1
    assert results["summary"]["num_ok"] == 3 and results["summary"]["num_errors"] == 1
    assert results["summary"]["errors"] == {"HTTP 500: boom": 1}
    captured = capsys.readouterr()
    assert "time to first token" in captured.out and "1 failed" in captured.out
    assert "kvfleet bench: 1 of 4 requests failed: HTTP 500: boom" in captured.err


def test_requests_cut_at_the_duration_limit_do_not_fail_the_run(fake, tmp_path, capsys):
    """The operator's limit cancels what still runs: counted as failed in the report, not an
    error of the server; the run exits 0 when every other request succeeded."""
    fake.behaviour = replace(fake.behaviour, first_token_delay_s=0.05, token_delay_s=0.2)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"t": 0, "prompt": f"q{i}", "max_tokens": n})
                               for i, n in enumerate((1, 50))) + "\n")
    out = tmp_path / "out"
    code = bench.main([str(trace), "--url", fake.url, "--out", str(out), "--no-progress",
                       "--no-plots", "--rate", "inf", "--duration-limit", "0.6"])
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert (summary["num_ok"], summary["num_errors"]) == (1, 1)
    assert summary["errors"] == {"cancelled at the duration limit": 1}
    assert code == 0 and "failed" not in capsys.readouterr().err


def test_a_failure_at_a_load_the_sweep_passed_fails_the_run(fake, tmp_path, capsys):
    fake.behaviour = replace(fake.behaviour, first_token_delay_s=0.0, token_delay_s=0.005,
                             failing_prompts=("question 0",))
    code, _ = run_bench(fake, tmp_path, "--sweep", "--sweep-by", "concurrency",
                        "--sweep-loads", "1,2", "--sweep-goodput", "0.5", num_requests=4,
                        max_tokens=2)
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert sweep["best_load"] == 2  # 3 of 4 good at each load
    assert code == 1
    assert "kvfleet bench: 1 of 4 requests failed at concurrency 1: HTTP 500: boom" in \
        capsys.readouterr().err


def test_failures_at_the_load_that_ended_the_sweep_are_its_measurement(fake, tmp_path):
    fake.behaviour = replace(fake.behaviour, first_token_delay_s=0.0, token_delay_s=0.005,
                             failing_prompts=("question 0",))
    code, _ = run_bench(fake, tmp_path, "--sweep", "--sweep-by", "concurrency",
                        "--sweep-loads", "1,2", "--sweep-goodput", "0.9", num_requests=4,
                        max_tokens=2)
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert sweep["best_load"] is None and len(sweep["loads"]) == 1
    assert code == 0


def test_http_errors_are_recorded(fake, tmp_path, capsys):
    fake.behaviour = replace(fake.behaviour, status_code=429, num_workers=None)
    code, results = run_bench(fake, tmp_path, "--rate", "inf", "--no-plots", num_requests=2)
    assert code == 1
    assert results["summary"]["errors"] == {"HTTP 429: slow down": 2}
    assert results["run"]["num_workers_source"] == "assumed 1"
    assert "HTTP 429" in capsys.readouterr().err


def test_unreachable_server_exits_2(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        trace = write_trace(tmp_path / "trace.jsonl", 2)
        code = bench.main([trace, "--url", f"http://127.0.0.1:{port}", "--no-progress",
                           "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot reach" in err and "Traceback" not in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("content, message", [
    (None, "cannot read trace"),
    ('{"t": 0, "prompt": "hi", "max_tokens": 4}\n{oops\n', ":2: not valid JSON"),
    ('{"t": 0, "prompt": "hi", "max_tokens": 0}\n', "'max_tokens' must be an integer >= 1"),
    ('{"t": 0, "prompt": "hi", "max_tokens": 2, "model": ""}\n', "'model' must be a non-empty"),
    ("\n", "no requests in the trace"),
])
def test_bad_trace_exits_2(tmp_path, capsys, content, message):
    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    assert bench.main([str(path), "--url", "http://127.0.0.1:9", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--rate", "0"], ["--concurrency", "-1"],
                                  ["--sweep-goodput", "2"], ["--endpoint", "embeddings"]])
def test_bad_flag_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["trace.jsonl", *argv])
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_record_itl_and_pace_from_multi_token_chunks():
    record = RequestRecord(0, 0.0, 8, done=True, ttft_s=0.1, output_tokens=6,
                           chunk_offsets_s=[0.1, 0.2, 0.4])
    assert record.tokens_per_chunk == 2
    assert record.itl_s == pytest.approx([0.05, 0.1])
    assert record.tokens_per_s == pytest.approx(2 / 0.15)


def test_meets_slo_needs_success_a_fast_first_token_and_pace():
    slo = Slo(ttft_s=1.0, tokens_per_s=10)
    fast = RequestRecord(0, 0.0, 4, done=True, ttft_s=0.5, output_tokens=3,
                         chunk_offsets_s=[0.5, 0.55, 0.6])
    assert meets_slo(fast, slo)
    assert not meets_slo(replace(fast, ttft_s=1.5), slo)
    assert not meets_slo(replace(fast, chunk_offsets_s=[0.5, 0.8, 1.1]), slo)  # 3.3 tokens/s
    assert not meets_slo(replace(fast, error="HTTP 500: boom"), slo)
    assert not meets_slo(replace(fast, done=False), slo)
    single_chunk = replace(fast, chunk_offsets_s=[0.5])  # no pace to judge: TTFT decides
    assert single_chunk.tokens_per_s is None and meets_slo(single_chunk, slo)


def test_trace_takes_the_first_n_lines_and_starts_at_zero(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"t": t, "prompt": "p", "max_tokens": 3})
                              for t in (5.0, 5.5, 7.0, 9.0)))
    requests = load_trace(path, num_requests=3)
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 2.0]


def test_a_trace_line_may_name_its_model(tmp_path):
    """A trace spread over models or LoRA adapters: a line's `model` goes in its request's
    body; a line without one names the run's --model."""
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in (
        {"t": 1.0, "prompt": "a", "max_tokens": 2, "model": "adapter-1"},
        {"t": 2.0, "prompt": "b", "max_tokens": 2})))
    first, second = load_trace(path)
    assert (first.model, second.model, second.arrival_s) == ("adapter-1", None, 1.0)
    target = BenchTarget("base", "completions")
    assert request_body(target, first)["model"] == "adapter-1"
    assert request_body(target, second)["model"] == "base"
