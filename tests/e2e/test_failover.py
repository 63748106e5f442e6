"""Chaos: SIGKILL the worker serving streamed requests mid-answer; every client's stream continues
on the other worker with exactly the text an uninterrupted run gives — no gap, no repeat. On a
single Redis and on a Redis Cluster (3 primaries + 3 replicas, 3 stream shards). At the default
settings users get (`--dtype auto`: bf16 on CPUs with native bf16; `--deterministic`), not
ProcessFleet's float32: the resumed prefill must compute what the decode steps computed.

A third worker of other numerics (its linears pinned to oneDNN: another numerics fingerprint on
every CPU kind), which takes only orphaned streams, is alive meanwhile: the same-numerics rescuer
takes every stream first. Then the rescuer is killed too: the stranger, the only worker left,
resumes its streams; the clients get whole answers whose `system_fingerprint` names both
numerics."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import RequestRecord
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES
from tests.helpers.metrics import metric_total
from tests.helpers.processes import ProcessFleet
from tests.helpers.streams import when_streaming

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.topologies]

# long enough that every stream is mid-answer when the worker dies (killed at >= 10 checkpointed
# tokens each: 38 or more to go, as in test_drain.py), short enough for the suite's budget on a
# 2-core CPU
MAX_TOKENS = 48
# the stranger: its linears in oneDNN (kvfleet's product is the default everywhere,
# batch-invariant), another numerics fingerprint on every CPU kind; a decode worker (without
# peers that hand off, it serves only orphaned requests): it takes no new request from the others
STRANGER = {"KVFLEET_CPU_PRODUCTS": "onednn", "KVFLEET_ROLE": "decode"}
TOPICS = ["rivers", "mountains", "bread", "trains", "music", "chess", "the sea", "bees",
          "clocks", "libraries", "volcanoes", "bridges"]


def request_body(i: int) -> dict:
    body = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Write a long story about {TOPICS[i]}."}]}
    if i < 8:
        body["temperature"] = 0
    else:  # seeded sampling must resume the same random stream
        body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
    return body


def stream_text(url: str, body: dict, record: dict) -> None:
    """Stream one completion; record its text, chunk arrival times and id."""
    pieces, times = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            record.setdefault("id", chunk["id"])
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    pieces.append(choice["delta"]["content"])
                    times.append(time.monotonic())
                if choice.get("finish_reason"):
                    record["finish_reason"] = choice["finish_reason"]
                    record["system_fingerprint"] = chunk.get("system_fingerprint")
    record["text"] = "".join(pieces)
    record["times"] = times


def run_all(url: str, on_started=None, bodies: list | None = None,
            stream=stream_text) -> list[dict]:
    """Stream every body at once (default: one per topic) with `stream(url, body, record)`;
    `on_started` runs meanwhile."""
    bodies = bodies or [request_body(i) for i in range(len(TOPICS))]
    records = [dict() for _ in bodies]
    threads = [threading.Thread(target=stream, args=(url, body, record))
               for body, record in zip(bodies, records)]
    for thread in threads:
        thread.start()
    if on_started:
        on_started(records)
    for thread in threads:
        thread.join(timeout=900)
    return records


def test_sigkill_mid_stream_loses_and_repeats_nothing(redis_url, redis_topology, tmp_path):
    fleet = ProcessFleet(redis_url, tmp_path,
                         worker_flags=["--dtype", "auto", "--kv-memory", "256MiB",
                                       "--num-threads", "1", "--heartbeat-ttl-s", "2",
                                       "--heartbeat-interval-s", "0.5"],
                         queue_shards=3 if redis_topology == "cluster" else 1)
    client = connect(redis_url)
    try:
        (victim,) = fleet.start("victim")
        keys = fleet.keys

        def start_rescuer_once_the_victim_holds_all(records):
            """The rescuer loads its model while the reference streams, started only once the
            victim has taken every request: the reference runs uninterrupted on one worker."""
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                ids = [r.get("id") for r in records]
                if all(ids) and all(client.hget(keys.request(i), RequestRecord.WORKER) == b"victim"
                                    for i in ids):
                    fleet.start_worker("rescuer", wait=False)
                    fleet.start_worker("stranger", wait=False, env=STRANGER)
                    return
                time.sleep(0.05)
            raise AssertionError("the victim never took the reference requests")

        reference = run_all(fleet.url, on_started=start_rescuer_once_the_victim_holds_all)
        assert all(r["finish_reason"] == "length" for r in reference)
        fleet.wait_worker("rescuer")
        fleet.wait_worker("stranger")
        numerics = {w: client.hget(keys.worker(w), "numerics").decode()
                    for w in ("victim", "rescuer", "stranger")}
        assert numerics["victim"] == numerics["rescuer"] != numerics["stranger"]
        assert {r["system_fingerprint"] for r in reference} == {numerics["victim"]}

        def kill_when_streaming(name: str, holders: tuple[bytes, ...]):
            """SIGKILL `name` once it serves some of the requests and `holders` all of them,
            each with 10 tokens out."""
            return when_streaming(
                client, keys, lambda ids, owners, progress: name.encode() in owners
                and all(o in holders for o in owners) and min(progress) >= 10,
                lambda ids, owners: fleet.workers[name].kill(), f"{name} serving the requests")

        # The rescuer may take some requests first; the victim takes the rest.
        records = run_all(fleet.url, on_started=kill_when_streaming("victim", (b"victim",
                                                                               b"rescuer")))
        assert victim.popen.returncode == -9
        for got, want in zip(records, reference):
            assert got["finish_reason"] == "length"
            assert got["text"] == want["text"]
            assert got["system_fingerprint"] == numerics["victim"]  # one numerics throughout
        resumed = [r for r in records
                   if client.hget(keys.request(r["id"]), RequestRecord.ATTEMPT) not in (b"1", None)]
        assert resumed, "no request was resumed by the rescuer"
        assert all(client.hget(keys.request(r["id"]), RequestRecord.WORKER) == b"rescuer"
                   for r in resumed)  # not the stranger, alive all along

        # The rescuer dies too: the stranger, the only one left, resumes on other numerics.
        bodies = [request_body(i) for i in (0, 1, 8, 9)]
        records = run_all(fleet.url, bodies=bodies,
                          on_started=kill_when_streaming("rescuer", (b"rescuer",)))
        moved = [r for r in records
                 if client.hget(keys.request(r["id"]), RequestRecord.ATTEMPT) not in (b"1", None)]
        assert moved, "no request was resumed by the stranger"
        both = f'{numerics["rescuer"]}+{numerics["stranger"]}'
        for record in moved:
            assert record["finish_reason"] == "length" and record["text"]
            assert record["system_fingerprint"] == both
            assert client.hget(keys.request(record["id"]), RequestRecord.NUMERICS) == both.encode()
            assert client.strlen(keys.checkpoint(record["id"])) // TOKEN_BYTES == MAX_TOKENS
        metrics_url = client.hget(keys.worker("stranger"), "metrics_url").decode()
        assert metric_total(metrics_url, "kvfleet_worker_resumes_other_numerics_total") \
            == len(moved)
    finally:
        fleet.kill()
