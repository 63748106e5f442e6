"""Which other workers' own streams a fill reads, and under which rule (worker/affinity.py,
`OwnStreamOwners.due_reads`): entries that only waited are taken by an idle reader from an owner
carrying at least STEAL_LOAD_GAP requests; entries the owner cannot hold, and a gone owner's,
whatever the loads."""

from __future__ import annotations

import time

from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.worker.affinity import NEVER_MS, STEAL_LOAD_GAP, ForeignRead, OwnStreamOwners


def beat(running: int, own_queue: int = 0, blocks_free: int = 10) -> Heartbeat:
    return Heartbeat(model="m", ts=time.time(), blocks_total=100, blocks_free=blocks_free,
                     running=running, own_queue=own_queue, block_size=16)


def test_only_an_idle_worker_takes_entries_that_waited(redis_client):
    owners = OwnStreamOwners(redis_client, Keys("st:"), "m", "me", steal_after_ms=250,
                             refresh_s=60, gone_grace_s=60)
    owners.heartbeats = {"busy": beat(running=1, own_queue=1), "light": beat(running=1),
                         "gone": None, "unknown-room": Heartbeat(model="m", ts=time.time(),
                                                                 running=5)}
    assert STEAL_LOAD_GAP == 2
    reads = {r.owner: r for r in owners.due_reads(my_load=0)}
    assert reads["busy"] == ForeignRead("busy", 250, 160)  # waited 250 ms, or too big for it
    assert reads["light"] == ForeignRead("light", NEVER_MS, 160)  # only what it cannot hold
    assert reads["gone"] == ForeignRead("gone", 0, -1)  # every entry, at once
    assert reads["unknown-room"] == ForeignRead("unknown-room", 250, -1)
    # read again only after half the steal delay; a busy reader takes only what the owner
    # cannot hold (nothing where its room is unknown)
    assert owners.due_reads(my_load=0) == []
    owners._read_at.clear()
    assert {r.owner: r.min_age_ms for r in owners.due_reads(my_load=1)} == {
        "busy": NEVER_MS, "light": NEVER_MS, "gone": 0}
    # without a load (tests, tools), the delay alone decides
    owners._read_at.clear()
    assert {r.owner: r.min_age_ms for r in owners.due_reads()} == {
        "busy": 250, "light": 250, "gone": 0, "unknown-room": 250}
