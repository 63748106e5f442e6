"""End to end through real processes: HTTP -> gateway -> Redis stream -> worker -> pub/sub -> SSE,
on the default model."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import redis

from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.wire import Keys, RequestRecord
from tests.helpers.processes import ProcessFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat(url: str, messages, timeout_s: float = 120, **extra) -> dict:
    body = {"model": DEFAULT_MODEL, "messages": messages, "temperature": 0, "max_tokens": 40, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_served_model(fleet):
    data = httpx.get(f"{fleet.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in data["data"]] == [DEFAULT_MODEL]


def test_streamed_chat_completion_answers_sensibly(fleet):
    body = {"model": DEFAULT_MODEL, "messages": QUESTION, "stream": True, "max_tokens": 30,
            "temperature": 0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "stop"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 10


def test_the_dashboard_history_samples_the_live_fleet(fleet):
    """The gateway's sampler runs by itself (every 5 s by default): a point after our request
    counts the live worker and our request's first token."""
    asked_at = time.time()
    chat(fleet.url, QUESTION, max_tokens=5)
    deadline = time.monotonic() + 30
    while True:
        body = httpx.get(f"{fleet.url}/dashboard/history", timeout=10).json()
        after = [p for p in body["points"] if p["t"] > asked_at and p["ttft_count"] >= 1]
        if after:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    assert (body["history_s"], body["sample_s"]) == (900.0, 5.0)
    assert after[0]["workers"] >= 1 and after[0]["ttft_p50_s"] > 0
    assert after[0]["kv_usage_pct"] is not None and after[0]["queue_depth"] is not None


def test_greedy_output_equals_transformers_generate(fleet, hf_reference):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    answer = chat(fleet.url, messages, max_tokens=40)
    expected, num_tokens = hf_reference.greedy(messages, 40)
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["completion_tokens"] == num_tokens


def test_bad_json_and_unknown_model_are_openai_shaped_4xx(fleet):
    bad = httpx.post(f"{fleet.url}/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"}, timeout=10)
    assert bad.status_code == 400
    assert set(bad.json()["error"]) >= {"message", "type"}
    unknown = httpx.post(f"{fleet.url}/v1/chat/completions", timeout=10,
                         json={"model": "no-such-model", "messages": QUESTION})
    assert unknown.status_code == 404
    assert "no-such-model" in unknown.json()["error"]["message"]


def test_two_workers_share_one_queue(fleet):
    assert set(fleet.workers) == {"w0", "w-second"}
    client = redis.Redis.from_url(fleet.redis_url)
    prompts = [[{"role": "user", "content": f"Count from {i} to {i + 20}."}] for i in range(8)]
    results: list = [None] * len(prompts)

    def run(i):
        results[i] = chat(fleet.url, prompts[i], max_tokens=48, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(r is not None and r["usage"]["completion_tokens"] == 48 for r in results)
    keys = Keys(fleet.prefix)
    served_by = {client.hget(keys.request(r["id"]), RequestRecord.WORKER) for r in results}
    assert served_by == {b"w0", b"w-second"}


def test_a_request_queued_with_no_worker_is_served_when_one_starts(redis_server, tmp_path):
    fleet = ProcessFleet(redis_server.url, tmp_path)
    try:
        fleet.start_gateway()
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(chat(fleet.url, QUESTION)))
        thread.start()
        client = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 30
        while client.xlen(Keys(fleet.prefix).queue(DEFAULT_MODEL)) == 0:
            assert time.monotonic() < deadline, "request never reached the stream"
            time.sleep(0.1)
        assert not result
        fleet.start_worker()
        thread.join(timeout=180)
        assert "Paris" in result["choices"][0]["message"]["content"]
    finally:
        fleet.kill()
