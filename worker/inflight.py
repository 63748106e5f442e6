"""The streams this worker serves now, in one table that the service loop, the drain and the
handoffs share (worker/process/service.py, worker/handoff/): a stream joins when its attempt started here
(a delivery, a claim, a handoff taken) and leaves when it finished, was fenced, handed over or
given back. Beside it, the stream entries the heartbeat thread keeps fresh (`held`): an entry is
held from its delivery until its request ends here (or leaves), under a lock, as the heartbeat
thread reads them.

`StreamCalls` are the loop's own operations on a stream that the handoffs and the drain call (its
publication, its entry's release, its return to the queue, its start here); they get these, not
the service.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvfleet.shared.wire.scripts import Started
from kvfleet.worker.protocol import Delivery


@dataclass
class Inflight:
    delivery: Delivery
    attempt: int
    num_output_tokens: int = 0  # published (its checkpoint's length)
    numerics: str = ""  # the request's numerics chain (RequestRecord.NUMERICS) as started here


class InflightTable:
    """req_id -> the stream served here; and the stream entries held (kept fresh)."""

    def __init__(self) -> None:
        self._streams: dict[str, Inflight] = {}
        self._held: dict[str, set[str]] = {}  # stream -> entry ids; the heartbeat thread reads
        self._lock = threading.Lock()

    # ---- the streams (the loop thread) --------------------------------------------------------

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[str]:
        return iter(self._streams)

    def __getitem__(self, req_id: str) -> Inflight:
        return self._streams[req_id]

    def get(self, req_id: str) -> Inflight | None:
        return self._streams.get(req_id)

    def items(self) -> list[tuple[str, Inflight]]:
        """A snapshot: the caller may remove streams while it walks them."""
        return list(self._streams.items())

    def put(self, req_id: str, inflight: Inflight) -> None:
        self._streams[req_id] = inflight

    def pop(self, req_id: str) -> Inflight:
        """Remove a stream that leaves (KeyError when it is not here)."""
        return self._streams.pop(req_id)

    # ---- held entries (the loop writes, the heartbeat thread reads) ----------------------------

    def hold(self, delivery: Delivery) -> None:
        with self._lock:
            self._held.setdefault(delivery.stream, set()).add(delivery.entry_id)

    def release(self, delivery: Delivery) -> None:
        self.release_entry(delivery.stream, delivery.entry_id)

    def release_entry(self, stream: str, entry_id: str) -> None:
        with self._lock:
            self._held.get(stream, set()).discard(entry_id)

    def held(self) -> dict[str, list[str]]:
        """stream -> the entry ids held now, sorted."""
        with self._lock:
            return {stream: sorted(ids) for stream, ids in self._held.items() if ids}

    def held_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(e for ids in self._held.values() for e in ids)


@dataclass(frozen=True)
class StreamCalls:
    """The loop's operations on one stream that the handoffs and the drain call."""

    flush: Callable[[str], None]  # publish what its events hold back (req_id)
    left: Callable[[Inflight], None]  # handed to a peer that fenced it: stop refreshing its entry
    give_back: Callable[[Inflight], None]  # out of the engine: to checkpoint resume elsewhere
    resume: Callable[[Delivery, Started], None]  # fenced here, KV unusable: from the checkpoint
    adopt: Callable[[Delivery, Started], None]  # in the engine with its KV: serve it from here
