"""Resumes on the same numerics: which live workers of the model compute with which numerics
fingerprint (worker/engine/model/numerics.py), and how long this worker lets them go first.

A stream whose tokens so far were computed on numerics N continues bit for bit only on a worker
whose fingerprint is N (with batch-invariant numerics, the default). So a worker of other
numerics takes such a stream (an orphan to resume, a handoff offer) only once it has waited
`prefer_ms` longer than a worker of N would, and only while some live worker of N could take it
at all; where none is alive it takes it at once: an answer is never lost for the sake of its
numerics, and the final event then says it resumed on other numerics.

The model's live workers are its roster (`Keys.roster`: every worker stays on it with each
heartbeat); their fingerprints are their heartbeats' `numerics` field, read at most once per
`refresh_s`.
"""

from __future__ import annotations

import time

import redis

from kvfleet.shared.wire import Keys
from kvfleet.shared.wire.records import RequestRecord, text


def last_numerics(chain: str) -> str:
    """The fingerprint the last tokens of a stream were computed on ('' when none recorded)."""
    return chain.rsplit("+", 1)[-1]


class FleetNumerics:
    """This worker's fingerprint and the fleet's, for one model."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 fingerprint: str, prefer_ms: int, refresh_s: float = 1.0):
        self.client, self.keys, self.model = client, keys, model
        self.worker_id, self.fingerprint = worker_id, fingerprint
        self.prefer_ms, self.refresh_s = prefer_ms, refresh_s
        self._peers: dict[str, str] = {}  # live worker id -> its fingerprint (this one left out)
        self._read_at = -1e9

    @property
    def enabled(self) -> bool:
        """Whether this worker prefers workers of a stream's numerics at all (it knows its own
        fingerprint, and --numerics-prefer-ms is not 0)."""
        return bool(self.fingerprint) and self.prefer_ms > 0

    def peers(self) -> dict[str, str]:
        """The other live workers of the model and their fingerprints ('' for a worker that
        publishes none: an older version)."""
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            self._read_at = now
            members = [text(m) for m in self.client.zrange(self.keys.roster(self.model), 0, -1)]
            others = [m for m in members if m != self.worker_id]
            pipe = self.client.pipeline(transaction=False)
            for worker in others:
                pipe.hget(self.keys.worker(worker), "numerics")
            # a worker whose heartbeat is gone is not alive, whatever the roster still says
            self._peers = {worker: text(fp) for worker, fp in zip(others, pipe.execute())
                           if fp is not None}
        return self._peers

    def wait_ms(self, chain: str, gone: str = "") -> int:
        """The extra wait before this worker continues a stream whose tokens so far were
        computed on `chain` (RequestRecord.NUMERICS): 0 when no token was computed yet, when the
        last were computed on this worker's numerics, or when no other live worker (but `gone`,
        the stream's own dead or departing worker) has them; else `prefer_ms`."""
        wanted = last_numerics(chain)
        if not self.enabled or not wanted or wanted == self.fingerprint:
            return 0
        holders = [w for w, fp in self.peers().items() if fp == wanted and w != gone]
        return self.prefer_ms if holders else 0

    def chain_of(self, req_id: str) -> str:
        """The request's numerics chain as recorded (RequestRecord.NUMERICS)."""
        return text(self.client.hget(self.keys.request(req_id), RequestRecord.NUMERICS))
