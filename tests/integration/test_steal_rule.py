"""Which other workers' own streams a fill reads, and under which rule (worker/affinity.py,
`OwnStreamOwners.due_reads`): entries that only waited are taken from an owner carrying at least
twice the reader's load plus STEAL_LOAD_GAP requests; entries the owner cannot hold, and a gone
owner's, whatever the loads."""

from __future__ import annotations

import time

from shared.wire import Heartbeat, Keys
from worker.affinity import NEVER_MS, STEAL_LOAD_GAP, ForeignRead, OwnStreamOwners


def beat(running: int, own_queue: int = 0, blocks_free: int = 10) -> Heartbeat:
    return Heartbeat(model="m", ts=time.time(), blocks_total=100, blocks_free=blocks_free,
                     running=running, own_queue=own_queue, block_size=16)


def test_only_a_busier_owner_gives_up_entries_that_waited(redis_client):
    owners = OwnStreamOwners(redis_client, Keys("st:"), "m", "me", steal_after_ms=250,
                             refresh_s=60, gone_grace_s=60)
    owners.heartbeats = {"busy": beat(running=5, own_queue=1), "even": beat(running=5),
                         "gone": None, "unknown-room": Heartbeat(model="m", ts=time.time(),
                                                                 running=0)}
    reads = {r.owner: r for r in owners.due_reads(my_load=2)}
    assert 6 >= 2 * 2 + STEAL_LOAD_GAP > 5
    assert reads["busy"] == ForeignRead("busy", 250, 160)  # waited 250 ms, or too big for it
    assert reads["even"] == ForeignRead("even", NEVER_MS, 160)  # only what it cannot hold
    assert reads["gone"] == ForeignRead("gone", 0, -1)  # every entry, at once
    assert "unknown-room" not in reads  # as loaded as this worker, its room unknown: nothing
    # read again only after half the steal delay; without a load, the delay alone decides
    assert owners.due_reads(my_load=0) == []
    owners._read_at.clear()
    assert {r.owner: r.min_age_ms for r in owners.due_reads()} == {
        "busy": 250, "even": 250, "gone": 0, "unknown-room": 250}
