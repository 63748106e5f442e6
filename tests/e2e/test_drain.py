"""Drain at the default settings users get (`--dtype auto`, `--deterministic`): SIGTERM a
worker serving streamed requests mid-answer; it hands every stream running there with its KV to
the other workers, which continue them without recompute, and exits 0: every client gets
exactly the text an uninterrupted run gives. Then a source SIGKILLed during its drain (what was
handed over continues, the rest resumes from its checkpoint), and a taker SIGKILLed right after
it took streams with their KV (a rescuer resumes them from checkpoints): still no gap, no
repeat.

Each fault is placed, not timed: each signal waits for a state (a log line, a heartbeat field,
an offer in Redis), and the workers that must not act meanwhile are paused (SIGSTOP, for well
under the heartbeat TTL). Workers load side by side, or while the previous part's streams run.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import Heartbeat
from tests.e2e.test_failover import TOPICS, request_body, run_all
from tests.helpers.metrics import metric_total
from tests.helpers.processes import Proc, ProcessFleet
from tests.helpers.streams import when_streaming
from kvfleet.worker.handoff.protocol import HandoffProtocol
from kvfleet.worker.handoff.transfer import TcpTransferPlane

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LEASE_S = 5  # --handoff-lease-s: streams sent to a taker that died come back after it
# Signalled at >= 10 checkpointed tokens each, a stream has up to 38 more to go: about 3 s of
# steps on a 2-core Zen 4 shared with other tests, where a drain's handoffs took 0.15-0.3 s.
BODIES = [dict(request_body(i), max_tokens=48) for i in range(len(TOPICS))]
FALLBACKS, TAKEOVERS = "kvfleet_worker_handoff_fallbacks_total", "kvfleet_worker_takeovers_total"


def handed(proc: Proc) -> set[str]:
    """The requests a source's log says it handed to a peer that took them with their KV."""
    return set(re.findall(r"handed (\S+) to a peer with its KV", proc.log_text()))


def taken(proc: Proc, source: str) -> set[str]:
    """The requests a taker's log says it took from `source` with their KV."""
    return set(re.findall(rf"took (\S+) from {re.escape(source)} with its KV", proc.log_text()))


def took_over(proc: Proc) -> list[str]:
    """The requests a worker's log says it resumed from their checkpoints (a dead worker's)."""
    return re.findall(r"took over (\S+) from a worker whose heartbeat is gone", proc.log_text())


def wait_until(ready, what: str, timeout_s: float = 60, poll_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := ready():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def when_serving(client, keys, worker_id: str, act, min_held: int = 2, min_tokens: int = 10):
    """A `run_all` hook: once `worker_id` holds `min_held` of the requests and every one has
    `min_tokens` checkpointed tokens, `act(ids of the requests it holds)`."""
    def held(ids, owners) -> set[str]:
        return {i for i, owner in zip(ids, owners) if owner == worker_id.encode()}

    return when_streaming(
        client, keys, lambda ids, owners, progress: len(held(ids, owners)) >= min_held
        and min(progress) >= min_tokens, lambda ids, owners: act(held(ids, owners)),
        f"{worker_id} serving the requests")


def test_sigterm_drains_running_streams_to_a_peer_with_their_kv(redis_url, tmp_path):
    fleet = ProcessFleet(redis_url, tmp_path,
                         worker_flags=["--dtype", "auto", "--kv-memory", "256MiB",
                                       "--num-threads", "1", "--heartbeat-ttl-s", "2",
                                       "--heartbeat-interval-s", "0.5",
                                       "--handoff-lease-s", str(LEASE_S),
                                       "--handoff-advertise-host", "127.0.0.1"])
    client = connect(redis_url)
    keys = fleet.keys

    def beat(worker_id: str) -> Heartbeat:
        return Heartbeat.decode(client.hgetall(keys.worker(worker_id)))

    def same_texts(records):
        for got, want in zip(records, reference):
            assert got["finish_reason"] == "length"
            assert got["text"] == want["text"]

    try:
        # three workers load at once; the reference runs on them undisturbed (each stream on
        # one worker from start to end: with --deterministic, whichever worker and batch)
        victim, peer, victim_2 = fleet.start("victim", "peer", "victim-2")
        reference = run_all(fleet.url, bodies=BODIES)
        assert all(r["finish_reason"] == "length" for r in reference)
        assert beat("peer").handoff_addr.startswith("127.0.0.1:")

        # SIGTERM: every stream running on the victim goes to a peer with its KV.
        at_sigterm: set[str] = set()

        def drain_then_load_the_next(held):
            at_sigterm.update(held)
            victim.popen.send_signal(signal.SIGTERM)
            victim.wait_exit(timeout_s=60)
            fleet.start_worker("victim-3", wait=False)  # both load meanwhile: takers from here
            fleet.start_worker("rescuer", wait=False)

        records = run_all(fleet.url, bodies=BODIES, on_started=when_serving(
            client, keys, "victim", drain_then_load_the_next))
        assert victim.popen.returncode == 0, victim.log_text()[-3000:]
        same_texts(records)
        log = victim.log_text()
        running = int(re.search(r"draining: (\d+) requests here", log)[1])
        count = int(re.search(r"drained: (\d+) streams handed", log)[1])
        # every request the victim held at SIGTERM was running (>= 10 tokens each) and went to
        # a peer with its KV: none given back, none taken back after its lease, none resumed
        assert running == count == len(at_sigterm) >= 2, log[-3000:]
        assert handed(victim) == taken(peer, "victim") | taken(victim_2, "victim") == at_sigterm
        assert "not taken within its lease" not in log and "drain timeout" not in log
        assert beat("peer").handoffs_in + beat("victim-2").handoffs_in == count
        for worker_id in ("peer", "victim-2"):
            metrics = beat(worker_id).metrics_url
            assert metric_total(metrics, FALLBACKS) == metric_total(metrics, TAKEOVERS) == 0

        # A source SIGKILLed mid-drain: the streams it handed over continue on the takers; the
        # one still on its way to a taker (this test, which fetches it and never fences it: the
        # source keeps it for its lease) resumes from its checkpoint on a live worker.
        victim = victim_2
        others = [fleet.workers[w] for w in ("peer", "victim-3", "rescuer")]
        model = beat("victim-2").model
        test_taker = HandoffProtocol(client, keys, model, "drain-test")
        held_by_test: list[str] = []
        at_kill: dict = {}

        def offers_of_victim_2(held):
            mine = sorted((o for o in test_taker.offers() if o.worker_id == "victim-2"),
                          key=lambda o: o.req_id)
            return mine if {o.req_id for o in mine} == held else None

        def drain_then_kill(held):
            for other in others:  # the other takers (ready or still loading) wait
                other.popen.send_signal(signal.SIGSTOP)
            try:
                victim.popen.send_signal(signal.SIGTERM)
                offers = wait_until(lambda: offers_of_victim_2(held),
                                    "victim-2 offers its streams", timeout_s=1.5)
                offer = test_taker.take(offers[0].handoff_id)
                TcpTransferPlane().fetch(offer.addr, offer.handoff_id, timeout_s=5)
                held_by_test.append(offer.req_id)
            finally:
                for other in others:
                    other.popen.send_signal(signal.SIGCONT)
            rest = held - set(held_by_test)
            wait_until(lambda: handed(victim) == rest
                       and beat("victim-2").handoffs_out == len(rest), "the takers take the rest",
                       timeout_s=LEASE_S - 1)
            at_kill.update(held=held, beat=beat("victim-2"))
            victim.kill()  # SIGKILL, mid-drain

        records = run_all(fleet.url, bodies=BODIES, on_started=when_serving(
            client, keys, "victim-2", drain_then_kill))
        same_texts(records)
        log = victim.log_text()  # complete up to the SIGKILL
        # the drain was under way: begun, the rest handed, one stream still sent, not ended
        assert "draining:" in log and "drained:" not in log, log[-3000:]
        assert "not taken within its lease" not in log
        assert at_kill["beat"].draining == 1 and at_kill["beat"].handoffs_out >= 1
        rest = at_kill["held"] - set(held_by_test)
        assert handed(victim) == set().union(*(taken(w, "victim-2") for w in others)) == rest
        # resumed once, by whichever live worker's orphan check came first; nothing else was
        assert [req_id for w in others for req_id in took_over(w)] == held_by_test
        fleet.wait_worker("victim-3")
        fleet.wait_worker("rescuer")
        for worker_id, proc in zip(("peer", "victim-3", "rescuer"), others):
            metrics = beat(worker_id).metrics_url
            assert metric_total(metrics, FALLBACKS) == 0
            assert metric_total(metrics, TAKEOVERS) == len(took_over(proc))

        # The taker SIGKILLed right after it took streams with their KV: the rescuer (paused
        # meanwhile, so that the peer is the taker) resumes them from their checkpoints.
        victim, rescuer = fleet.workers["victim-3"], fleet.workers["rescuer"]
        taken_before = beat("peer").handoffs_in
        killed_holding: set[str] = set()

        def drain_then_kill_the_taker(held):
            rescuer.popen.send_signal(signal.SIGSTOP)
            try:
                victim.popen.send_signal(signal.SIGTERM)
                wait_until(lambda: beat("peer").handoffs_in > taken_before,
                           "the peer takes a stream", timeout_s=1.5)
                peer.kill()  # SIGKILL, holding streams it took with their KV
            finally:
                rescuer.popen.send_signal(signal.SIGCONT)
            killed_holding.update(taken(peer, "victim-3"))

        records = run_all(fleet.url, bodies=BODIES, on_started=when_serving(
            client, keys, "victim-3", drain_then_kill_the_taker))
        assert peer.popen.returncode == -9
        same_texts(records)
        assert killed_holding and killed_holding <= set(took_over(rescuer))
    finally:
        for proc in fleet.workers.values():  # never leave one paused
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
        fleet.kill()
