"""Request timelines (worker/timelines.py, shared/wire/timeline.py, `kvfleet timelines`): a worker
on a tiny engine and a real Redis records where each finished request's time went, a resume
records the worker that finished it, and `--timelines-kept 0` records nothing."""

from __future__ import annotations

import json
import time

import pytest

from kvfleet import cli
from kvfleet.shared.wire import SamplingParams
from kvfleet.shared.wire.timeline import RequestTimeline, percentile, summarize
from tests.engine.tiny_models import random_prompt
from tests.integration.test_worker_service import MODEL, client, make_service, run_until, tiny  # noqa: F401 (fixtures)

pytestmark = pytest.mark.topologies


def send(client, req_id: str, prompt, max_tokens: int, created: float) -> None:
    """What the gateway does, with its enqueue time (`created`)."""
    client.send(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                req_id=req_id, created=created)


def timelines_json(redis_url: str, capsys, *more: str) -> dict:
    assert cli.main(["timelines", "--redis-url", redis_url, "--json", *more]) == 0
    return json.loads(capsys.readouterr().out)


def read(client) -> dict[str, RequestTimeline]:
    entries = client.redis.xrange(client.keys.timelines(MODEL))
    return {t.req_id: t for t in (RequestTimeline.decode(fields) for _, fields in entries)}


def test_each_finished_request_leaves_its_timeline(redis_url, client, tiny, capsys):
    worker = make_service(redis_url, tiny, "w1")
    enqueued = time.time() - 0.25  # the gateway enqueued them a quarter of a second ago
    for i, max_tokens in enumerate((12, 7)):
        send(client, f"t-{i}", random_prompt(9 + i, seed=i), max_tokens, enqueued)
    run_until(worker, lambda: len(read(client)) == 2)
    timelines = read(client)
    for req_id, max_tokens in (("t-0", 12), ("t-1", 7)):
        t = timelines[req_id]
        assert t.worker == "w1" and t.finish == "length" and t.created == pytest.approx(enqueued)
        assert t.created < t.pulled <= t.started <= t.first <= t.last <= t.end
        assert t.output_tokens == max_tokens and t.resumed == 0 and t.deliveries == 1
        assert t.prompt_tokens == 9 + int(req_id[-1])
        # one publication per step, one token each: a gap between each two
        assert t.gaps == max_tokens - 1
        assert 0 < t.gap_max_ms <= t.gap_sum_ms == pytest.approx((t.last - t.first) * 1000, abs=0.01)
        phases = t.phases_ms()
        assert phases["queue"] >= 250 and phases["ttft"] >= phases["queue"] + phases["prefill"]
    summary = timelines_json(redis_url, capsys, "--since", str(enqueued))
    assert summary["count"] == 2 and summary["output_tokens"] == 19
    assert summary["workers"] == ["w1"] and summary["resumed"] == 0
    assert set(summary["phases"]) == {"queue", "admit", "prefill", "ttft", "tpot", "gap max"}
    assert summary["phases"]["queue"]["p50_ms"] >= 250
    # only requests that ended since a time: none ended in the future
    assert timelines_json(redis_url, capsys, "--since", str(time.time() + 60))["count"] == 0
    assert cli.main(["timelines", "--redis-url", redis_url, "--worst", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("2 requests on 1 worker(s)") and "| ttft |" in text
    assert text.count(" on w1: ") == 1  # the one latest first token


def test_a_resumed_request_is_recorded_by_the_worker_that_finished_it(redis_url, client, tiny):
    prompt = random_prompt(9, seed=2)
    dying = make_service(redis_url, tiny, "dying")
    send(client, "r-resumed", prompt, 20, time.time())
    run_until(dying, lambda: (client.drain(), len(client.text("r-resumed")) >= 6)[1])
    time.sleep(0.4)  # `dying` stops without a word; its entry goes idle
    rescuer = make_service(redis_url, tiny, "rescuer")
    run_until(rescuer, lambda: "r-resumed" in read(client))
    t = read(client)["r-resumed"]
    assert t.worker == "rescuer" and t.deliveries == 2
    assert t.resumed >= 6 and t.output_tokens == 20 - t.resumed
    assert len(read(client)) == 1  # the dead worker recorded nothing


def test_kept_zero_records_nothing(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w-off", timelines_kept=0)
    send(client, "t-off", random_prompt(5, seed=4), 3, time.time())
    run_until(worker, lambda: client.final("t-off"))
    assert not client.redis.exists(client.keys.timelines(MODEL))


def test_the_summary_takes_percentiles_over_requests():
    def timeline(i: int, ttft_s: float) -> RequestTimeline:
        return RequestTimeline(f"r{i}", "w", created=100.0, pulled=100.0 + ttft_s / 2,
                               started=100.0 + ttft_s / 2, first=100.0 + ttft_s,
                               last=101.0 + ttft_s, end=101.0 + ttft_s, output_tokens=11,
                               gaps=10, gap_sum_ms=1000.0, gap_max_ms=150.0)

    timelines = [timeline(i, 0.1 * (i + 1)) for i in range(10)]
    assert [RequestTimeline.decode(t.encode()) for t in timelines] == timelines
    summary = summarize(timelines)
    ttft = summary["phases"]["ttft"]
    assert ttft["p50_ms"] == pytest.approx(550) and ttft["max_ms"] == pytest.approx(1000)
    assert ttft["p99_ms"] == pytest.approx(percentile([100.0 * (i + 1) for i in range(10)], 99))
    assert summary["phases"]["tpot"]["p50_ms"] == pytest.approx(100)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([5.0], 99) == 5.0
