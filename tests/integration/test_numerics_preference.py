"""Resumes on the same numerics, against a real Redis and a real Redis Cluster: a dead worker's
stream goes first to a live worker of the numerics its tokens were computed on; a worker of
other numerics takes it only after `prefer_ms` more, or at once when no such worker is alive;
the request's record and the start say so."""

from __future__ import annotations

import time

import pytest

from kvfleet.shared.wire import Heartbeat, Keys, encode_checkpoint
from tests.integration.test_worker_protocol import MODEL, enqueue
from kvfleet.worker.numerics import FleetNumerics, last_numerics
from kvfleet.worker.protocol import WorkerProtocol

pytestmark = pytest.mark.topologies

PREFER_MS = 400


def worker(client, worker_id: str, numerics: str, ttl_s: float = 5.0):
    """A live worker of `numerics`: on the roster (with the fleet's TTL), beating (for `ttl_s`),
    with its FleetNumerics."""
    protocol = WorkerProtocol(client, Keys(), MODEL, worker_id, result_ttl_s=60,
                              numerics=numerics)
    protocol.ensure_groups()
    protocol.heartbeat(Heartbeat(model=MODEL, ts=0.0, numerics=numerics), ttl_s=ttl_s)
    protocol.update_roster(5.0)
    return protocol, FleetNumerics(client, Keys(), MODEL, worker_id, numerics, PREFER_MS,
                                   refresh_s=0.0)


def dead_stream(client, numerics: str, req_id: str = "r"):
    """A stream started by a worker of `numerics` that computed 2 tokens and died."""
    dead, _ = worker(client, "dead", numerics, ttl_s=0.2)
    enqueue(client, Keys(), req_id)
    dead.read_new(Keys().queue(MODEL), None)
    assert dead.start_attempt(req_id).numerics == numerics
    client.set(Keys().checkpoint(req_id), encode_checkpoint([5, 6]))
    time.sleep(0.3)  # its heartbeat is gone


def test_the_last_fingerprint_of_a_chain():
    assert last_numerics("fp_a+fp_b") == "fp_b" and last_numerics("fp_a") == "fp_a"
    assert last_numerics("") == ""


def test_a_same_numerics_worker_resumes_first_another_only_later(redis_client):
    other, other_numerics = worker(redis_client, "other", "fp_b")
    same, same_numerics = worker(redis_client, "same", "fp_a")
    dead_stream(redis_client, "fp_a")
    assert other_numerics.wait_ms("fp_a", gone="dead") == PREFER_MS
    assert same_numerics.wait_ms("fp_a", gone="dead") == 0
    assert other.claim_orphan(10, numerics=other_numerics) is None  # not idle long enough
    delivery = same.claim_orphan(10, numerics=same_numerics)
    assert delivery.request.req_id == "r"
    started = same.start_attempt("r")
    assert (started.checkpoint, started.numerics, started.other_numerics) == ([5, 6], "fp_a",
                                                                               False)


def test_another_numerics_takes_over_after_the_wait(redis_client):
    other, other_numerics = worker(redis_client, "other", "fp_b")
    worker(redis_client, "same", "fp_a")  # alive, but never claims (full, say)
    dead_stream(redis_client, "fp_a")
    assert other.claim_orphan(10, numerics=other_numerics) is None
    time.sleep(PREFER_MS / 1000)
    delivery = other.claim_orphan(10, numerics=other_numerics)
    assert delivery.request.req_id == "r"
    started = other.start_attempt("r")
    assert (started.numerics, started.other_numerics) == ("fp_a+fp_b", True)
    assert redis_client.hget(Keys().request("r"), "numerics") == b"fp_a+fp_b"


def test_with_no_same_numerics_worker_alive_another_takes_it_at_once(redis_client):
    other, other_numerics = worker(redis_client, "other", "fp_b")
    dead_stream(redis_client, "fp_a")
    assert other_numerics.wait_ms("fp_a", gone="dead") == 0
    assert other.claim_orphan(10, numerics=other_numerics).request.req_id == "r"
    assert other.start_attempt("r").other_numerics


def test_a_stream_with_no_token_yet_and_an_unknown_numerics_wait_for_nobody(redis_client):
    _, other_numerics = worker(redis_client, "other", "fp_b")
    worker(redis_client, "same", "fp_a")
    assert other_numerics.wait_ms("") == 0  # nothing computed yet: any worker starts it alike
    assert other_numerics.wait_ms("fp_a") == PREFER_MS
    assert other_numerics.wait_ms("fp_a", gone="same") == 0  # its only holder is the departing
    unknown = FleetNumerics(redis_client, Keys(), MODEL, "old", "", PREFER_MS, refresh_s=0.0)
    assert unknown.wait_ms("fp_a") == 0  # a worker that knows no numerics prefers none
    off = FleetNumerics(redis_client, Keys(), MODEL, "x", "fp_b", 0, refresh_s=0.0)
    assert off.wait_ms("fp_a") == 0  # --numerics-prefer-ms 0


def test_a_worker_whose_heartbeat_is_gone_holds_no_numerics(redis_client):
    _, other_numerics = worker(redis_client, "other", "fp_b")
    worker(redis_client, "brief", "fp_a", ttl_s=0.2)
    assert other_numerics.peers() == {"brief": "fp_a"}
    time.sleep(0.3)
    assert other_numerics.peers() == {}
    assert other_numerics.wait_ms("fp_a") == 0
