"""Speculative decoding through the fleet, at the default dtype (bf16 on CPUs with native bf16)
and `--deterministic`: workers with `--speculative-config` stream exactly the text a plain worker
streams, and when one is SIGKILLed mid-answer the other resumes the streams (speculating too)
and still gives plain decoding's text, greedy and seeded sampling alike."""

from __future__ import annotations

import json
import signal
import time

import pytest

from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import Heartbeat, RequestRecord
from tests.e2e.test_failover import run_all as stream_all
from tests.helpers.metrics import metric_total
from tests.helpers.processes import ProcessFleet
from tests.helpers.streams import when_streaming

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 72
TEXTS = [
    "The river runs past the old mill, under the stone bridge and out to the sea. In spring "
    "it floods the meadow; in autumn it is low and clear.",
    "def total(prices, tax):\n    subtotal = sum(prices)\n    return subtotal + subtotal * tax\n",
    "Bread needs flour, water, salt and yeast. Mix them, knead the dough, let it rise, shape "
    "it, let it rise again and bake it until it sounds hollow.",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 5}


def request_body(i: int) -> dict:
    text = TEXTS[i % len(TEXTS)]
    body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user",
                          "content": f"Repeat this text exactly, twice:\n\n{text}"}]}
    if i < len(TEXTS):
        body["temperature"] = 0
    else:
        body.update(temperature=0.7, top_p=0.95, seed=500 + i)
    return body


def run_all(url: str, on_started=None) -> list[dict]:
    return stream_all(url, on_started, [request_body(i) for i in range(2 * len(TEXTS))])


def test_speculating_workers_answer_as_a_plain_one_across_a_kill(redis_url, tmp_path):
    flags = ["--dtype", "auto", "--kv-memory", "256MiB", "--num-threads", "1",
             "--heartbeat-ttl-s", "2", "--heartbeat-interval-s", "0.5"]
    fleet = ProcessFleet(redis_url, tmp_path, worker_flags=flags)
    client = connect(redis_url)
    try:
        (plain,) = fleet.start("plain")
        keys = fleet.keys
        fleet.worker_flags = [*flags, "--speculative-config", json.dumps(SPEC)]

        # the speculating victim loads while the plain worker, which has taken every request,
        # streams the reference; then the plain worker leaves (SIGTERM: it stops serving)
        reference = run_all(fleet.url, on_started=when_streaming(
            client, keys, lambda ids, owners, progress: all(o == b"plain" for o in owners),
            lambda ids, owners: fleet.start_worker("victim", wait=False),
            "the plain worker serving every request"))
        assert all(r["finish_reason"] == "length" for r in reference)
        plain.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "worker plain stopped" not in plain.log_text():
            assert time.monotonic() < deadline, plain.log_text()[-3000:]
            time.sleep(0.02)
        fleet.wait_worker("victim")
        victim = fleet.workers["victim"]

        def start_rescuer_kill_victim(ids, owners):
            fleet.start_worker("rescuer", wait=False)
            victim.kill()  # SIGKILL

        # once the victim streams every request: start the rescuer, kill the victim
        kill_when_streaming = when_streaming(
            client, keys, lambda ids, owners, progress: all(o == b"victim" for o in owners)
            and min(progress) >= 8, start_rescuer_kill_victim, "the victim streaming every request",
            poll_s=0.02)

        records = run_all(fleet.url, on_started=kill_when_streaming)
        assert victim.popen.returncode == -9
        for i, (got, want) in enumerate(zip(records, reference)):
            assert got["finish_reason"] == "length"
            assert got["text"] == want["text"], f"request {i}"
        resumed = [r for r in records
                   if client.hget(keys.request(r["id"]), RequestRecord.ATTEMPT) not in (b"1", None)]
        assert len(resumed) == len(records)
        beat = Heartbeat.decode(client.hgetall(keys.worker("rescuer")))
        accepted = metric_total(beat.metrics_url,
                                "kvfleet_worker_spec_decode_num_accepted_tokens_total")
        assert accepted > 0, "the rescuer's speculation accepted nothing"
    finally:
        client.close()
        fleet.kill()
