"""Drain at the default settings users get (`--dtype auto`, `--deterministic`): SIGTERM the
worker serving streamed requests mid-answer; it hands every running stream with its KV to the
other worker, which continues them without recompute, and exits 0: every client gets exactly
the text an uninterrupted run gives. Then a source SIGKILLed during its drain (whatever was
handed over continues, the rest resumes from checkpoints), and a taker SIGKILLed right after it
took streams with their KV (a rescuer resumes them from checkpoints): still no gap, no repeat."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from shared.redis_connect import connect
from shared.wire import Heartbeat, RequestRecord
from shared.wire.checkpoint import TOKEN_BYTES
from tests.e2e.test_failover import run_all
from tests.helpers.processes import ProcessFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def metric_total(url: str, name: str, **labels) -> float:
    text = httpx.get(url, timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def when_serving(client, keys, worker_id: str, act, min_held: int = 2, min_tokens: int = 10):
    """A `run_all` hook: once `worker_id` holds `min_held` of the requests and every one has
    `min_tokens` checkpointed tokens, `act()`."""
    def hook(records):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ids = [r.get("id") for r in records]
            if all(ids):
                owners = [client.hget(keys.request(i), RequestRecord.WORKER) for i in ids]
                progress = [client.strlen(keys.checkpoint(i)) // TOKEN_BYTES for i in ids]
                if owners.count(worker_id.encode()) >= min_held and min(progress) >= min_tokens:
                    act()
                    return
            time.sleep(0.05)
        raise AssertionError(f"{worker_id} never served the requests")
    return hook


def test_sigterm_drains_running_streams_to_a_peer_with_their_kv(redis_url, tmp_path):
    fleet = ProcessFleet(redis_url, tmp_path,
                         worker_flags=["--dtype", "auto", "--kv-memory", "256MiB",
                                       "--num-threads", "1", "--heartbeat-ttl-s", "2",
                                       "--heartbeat-interval-s", "0.5",
                                       "--handoff-advertise-host", "127.0.0.1"])
    client = connect(redis_url)
    keys = fleet.keys
    try:
        (victim,) = fleet.start("victim")

        # the peer loads once the victim holds every request: the reference is undisturbed
        reference = run_all(fleet.url, on_started=when_serving(
            client, keys, "victim", lambda: fleet.start_worker("peer", wait=False),
            min_held=12, min_tokens=0))
        assert all(r["finish_reason"] == "length" for r in reference)
        fleet.wait_worker("peer")
        peer_beat = Heartbeat.decode(client.hgetall(keys.worker("peer")))
        assert peer_beat.handoff_addr.startswith("127.0.0.1:")

        records = run_all(fleet.url, on_started=when_serving(
            client, keys, "victim", lambda: victim.popen.send_signal(signal.SIGTERM)))
        victim.wait_exit(timeout_s=60)
        assert victim.popen.returncode == 0, victim.log_text()[-3000:]
        for got, want in zip(records, reference):
            assert got["finish_reason"] == "length"
            assert got["text"] == want["text"]
        log = victim.log_text()
        assert "drained:" in log, log[-3000:]
        handed = int(re.search(r"drained: (\d+) streams handed", log)[1])
        assert handed >= 1
        beat = Heartbeat.decode(client.hgetall(keys.worker("peer")))
        assert beat.handoffs_in == handed
        assert metric_total(beat.metrics_url, "kvfleet_worker_handoff_fallbacks_total") == 0
        assert metric_total(beat.metrics_url, "kvfleet_worker_takeovers_total") == 0

        # A source SIGKILLed mid-drain: streams handed over continue, the rest resume.
        (victim,) = [fleet.start_worker("victim-2")]

        def drain_then_kill():
            victim.popen.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            victim.kill()  # SIGKILL, mid-drain

        records = run_all(fleet.url, on_started=when_serving(client, keys, "victim-2",
                                                             drain_then_kill))
        for got, want in zip(records, reference):
            assert got["finish_reason"] == "length"
            assert got["text"] == want["text"]

        # The taker SIGKILLed right after it took streams with their KV: a rescuer resumes
        # them from their checkpoints.
        peer = fleet.workers["peer"]
        (victim,) = [fleet.start_worker("victim-3")]
        taken_before = Heartbeat.decode(client.hgetall(keys.worker("peer"))).handoffs_in

        def drain_then_kill_the_taker():
            victim.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                beat = Heartbeat.decode(client.hgetall(keys.worker("peer")))
                if beat.handoffs_in > taken_before:
                    peer.kill()  # SIGKILL, holding streams it took with their KV
                    fleet.start_worker("rescuer", wait=False)
                    return
                time.sleep(0.01)
            raise AssertionError("the peer never took a stream")

        records = run_all(fleet.url, on_started=when_serving(client, keys, "victim-3",
                                                             drain_then_kill_the_taker))
        assert peer.popen.returncode == -9
        for got, want in zip(records, reference):
            assert got["finish_reason"] == "length"
            assert got["text"] == want["text"]
    finally:
        fleet.stop()
