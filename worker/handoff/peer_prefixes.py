"""Prefixes fetched from peers (`--kv-peer-fetch`): the fleet's prefix caches as one.

When routing cannot send a request to the worker that holds its prompt opening (that worker is
full, draining or gone, the steal rule fired, load won over affinity), the worker that took it
would compute the whole opening again, though another worker holds its KV blocks and the
transfer plane moves KV at a large share of the wire's rate. Here the worker that admits the
request asks the fleet (worker/affinity.py `prefix_holders`: the workers' announcements) who
holds more of it than its own cache, in either tier, and fetches the difference when:

- the holder is live, has a transfer plane and the same numerics fingerprint (its blocks hold
  the bytes this worker would compute: the answer does not change);
- the difference is at least --kv-peer-fetch-min-tokens;
- the estimate says fetching is faster: its bytes over the plane's measured rate (until a fetch
  measured it, DEFAULT_WIRE_RATE) plus FETCH_OVERHEAD_S, against the prefill time of those
  tokens on this worker's fitted step-cost curve (before it is fitted, fetching is taken).

The request waits out of the engine, its entry held (kept fresh) and its room reserved against
admission, while a fetch thread brings the blocks; the loop installs them in the prefix cache
between two steps (`PrefixCopies.install`) and adds the request, whose lookup then finds them.
A request whose prefix is being fetched already joins that fetch. A fetch that fails, is
refused, brings another layout or is not done by its deadline (the estimated prefill time,
within [MIN_WAIT_S, MAX_WAIT_S]) lets its requests in to compute the prefix, never to an error;
a late fetch's blocks are still installed when they arrive. A cancel or a drain lets the waiting
requests in at once.

The holder's side: a plane request whose id starts with PREFIX_ID names the hashes asked for;
the holder's loop copies the leading run it holds, between two steps (`PrefixCopies.export`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvfleet.shared.pace import StepFeatures
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire.prefix_hash import BlockHash, block_hashes
from kvfleet.shared.wire.scripts import Started
from kvfleet.worker.affinity import PrefixHolder
from kvfleet.worker.engine.core.handoff import HandoffError
from kvfleet.worker.engine.tiers.prefix_copies import PrefixState
from kvfleet.worker.handoff.transfer import Outgoing, TransferError, TransferPlane
from kvfleet.worker.protocol import Delivery
from kvfleet.worker.tier_metrics import TierMetrics

log = logging.getLogger(__name__)

_HEX = frozenset("0123456789abcdefABCDEF")
PREFIX_ID = "prefix:"  # a plane request for blocks: this, then their hashes in hex, in order
DEFAULT_WIRE_RATE = 1e9  # bytes/s assumed until a fetch measured the plane (loopback: ~3e9)
FETCH_OVERHEAD_S = 0.02  # connecting, and the holder's loop answering between two of its steps
MIN_WAIT_S, MAX_WAIT_S = 0.25, 10.0  # a fetch's deadline, whatever the estimate
NO_ESTIMATE_WAIT_S = 2.0  # its deadline before the step-cost curve is fitted


def prefix_id(hashes: list[BlockHash]) -> str:
    return PREFIX_ID + "".join(h.hex() for h in hashes)


def parse_prefix_id(text: str) -> list[BlockHash] | None:
    """The hashes a prefix id asks for; None for one that is not well formed."""
    body = text.removeprefix(PREFIX_ID)
    digest = 32  # hex digits of a 16-byte block hash
    if not body or len(body) % digest or not _HEX.issuperset(body):
        return None
    try:
        return [bytes.fromhex(body[i:i + digest]) for i in range(0, len(body), digest)]
    except ValueError:
        return None


@dataclass
class _Waiting:
    delivery: Delivery
    started: Started
    joined: bool  # joined a fetch another request started


@dataclass
class _Fetch:
    """One fetch in progress and the requests waiting for it."""

    holder: PrefixHolder
    hashes: list[BlockHash]  # asked for, in chain order
    keep: list[BlockHash]  # the prompt's blocks cached here before them
    future: Future
    started: float  # time.monotonic()
    deadline: float
    estimate_s: float | None  # the estimated prefill time of its blocks (None: no curve yet)
    waiting: dict[str, _Waiting] = field(default_factory=dict)  # req_id -> request


class PeerPrefixes:
    """One worker's prefix fetches (the loop thread calls every method; the fetches run in a
    thread of their own)."""

    def __init__(self, settings: WorkerSettings, engine, metrics: TierMetrics,
                 holders: Callable[[list[BlockHash], int], list[PrefixHolder]], numerics: str,
                 root: BlockHash, plane: TransferPlane | None,
                 enter: Callable[[Delivery, Started], None]):
        """`holders(hashes, held)`: the live workers holding more than `held` leading blocks
        of `hashes` (Redis); `enter`: add a started request to the engine (the loop's)."""
        self.settings, self.engine, self.metrics = settings, engine, metrics
        self.holders, self.numerics, self.root = holders, numerics, root
        self.plane, self.enter = plane, enter
        copies = getattr(engine, "prefixes", None)
        gap = "the engine copies no prefix" if copies is None else copies.gap()
        if plane is None:
            gap = "no transfer plane"
        self.copies = copies
        self.enabled = (settings.kv_peer_fetch and settings.routing == "affinity"
                        and gap is None)
        if settings.kv_peer_fetch and settings.routing == "affinity" and gap is not None:
            log.info("prefixes are not fetched from peers: %s", gap)
        self._fetches: list[_Fetch] = []
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-prefix")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- the asker -------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Fetches in progress (the loop does not block waiting for new work meanwhile)."""
        return any(f.waiting for f in self._fetches)

    @property
    def num_waiting(self) -> int:
        return sum(len(f.waiting) for f in self._fetches)

    def waiting_delivery(self, req_id: str) -> Delivery | None:
        for fetch in self._fetches:
            if req_id in fetch.waiting:
                return fetch.waiting[req_id].delivery
        return None

    def reserved_tokens(self) -> int:
        """Room the waiting requests were admitted with (admission subtracts it)."""
        block = self.engine.config.cache.block_size
        return sum(len(w.delivery.request.prompt_token_ids) + block
                   for f in self._fetches for w in f.waiting.values())

    def hold(self, delivery: Delivery, started: Started) -> bool:
        """Whether the started request waits for a fetch of its prompt opening (the loop adds
        it to the engine later); False: add it now."""
        request = delivery.request
        if not self.enabled or request.lora:  # an adapter's blocks hash from its own root
            return False
        tokens = request.prompt_token_ids
        block_size = self.engine.config.cache.block_size
        hashes = block_hashes(tokens, block_size, self.root, (len(tokens) - 1) // block_size)
        min_blocks = -(-self.settings.kv_peer_fetch_min_tokens // block_size)
        held = self.copies.num_held(hashes)
        if len(hashes) - held < min_blocks:
            return False
        waiting = _Waiting(delivery, started, joined=True)
        now = time.monotonic()
        for fetch in self._fetches:  # the same opening on its way, in time: wait for it
            if fetch.hashes[0] == hashes[held] and now < fetch.deadline:
                fetch.waiting[request.req_id] = waiting
                return True
        try:
            holders = self.holders(hashes, held + min_blocks - 1)
        except REDIS_FAILURES as exc:
            log.debug("prefix holders of %s not read (%r)", request.req_id, exc)
            return False
        holder = next((h for h in holders if h.addr and h.numerics == self.numerics), None)
        if holder is None:
            return False
        wanted = hashes[held:holder.num_blocks]
        estimate_s = self._prefill_seconds(len(wanted) * block_size, held * block_size)
        fetch_s = len(wanted) * self.engine.pool.block_bytes / self._wire_rate() + FETCH_OVERHEAD_S
        if estimate_s is not None and fetch_s >= estimate_s:
            self.metrics.peer_fetch("slower")
            return False
        wait_s = NO_ESTIMATE_WAIT_S if estimate_s is None else min(MAX_WAIT_S,
                                                                     max(MIN_WAIT_S, estimate_s))
        future = self._threads.submit(self._fetch, holder.addr, wanted, wait_s)
        waiting.joined = False
        fetch = _Fetch(holder, wanted, hashes[:held], future, now, now + wait_s, estimate_s,
                       {request.req_id: waiting})
        self._fetches.append(fetch)
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until a fetch that requests wait for is done, at most `timeout_s` (an idle
        loop's pause, instead of spinning through admission while the blocks travel)."""
        pending = [f.future for f in self._fetches if f.waiting]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _prefill_seconds(self, num_tokens: int, start: int) -> float | None:
        pace = getattr(self.engine, "pace", None)
        curve = None if pace is None else pace.curve()
        if curve is None or not curve.fitted:
            return None
        return curve.step_seconds(StepFeatures.of_prefill(num_tokens, start))

    def _wire_rate(self) -> float:
        stats = getattr(self.plane, "stats", None)
        if stats is None or stats.payload_seconds <= 0 or stats.bytes_received < (1 << 20):
            return DEFAULT_WIRE_RATE
        return stats.bytes_received / stats.payload_seconds

    def _fetch(self, addr: str, hashes: list[BlockHash], timeout_s: float) -> PrefixState:
        """A fetch thread: the blocks from their holder."""
        header, payload = self.plane.fetch(addr, prefix_id(hashes), timeout_s)
        return PrefixState.decode(header, payload)

    def complete(self) -> None:
        """Between two steps: install the blocks of fetches done, and let in their requests
        and those of fetches past their deadline."""
        now = time.monotonic()
        for fetch in list(self._fetches):
            if fetch.future.done():
                self._fetches.remove(fetch)
                outcome = self._install(fetch, now)
                self._let_in(fetch, outcome)
            elif now >= fetch.deadline and fetch.waiting:
                log.info("prefix fetch from %s not done in %.2f s: computing it",
                         fetch.holder.worker_id, now - fetch.started)
                self._let_in(fetch, "late")

    def _install(self, fetch: _Fetch, now: float) -> str:
        try:
            state = fetch.future.result()
            installed = self.copies.install(state, fetch.keep)
        except HandoffError as exc:
            log.warning("prefix from %s not taken: %s", fetch.holder.worker_id, exc)
            return "incompatible"
        except (TransferError, OSError) as exc:
            log.info("prefix fetch from %s failed (%s): computing it", fetch.holder.worker_id, exc)
            return "failed"
        if not installed:
            return "failed"
        seconds = now - fetch.started
        block_bytes = self.engine.pool.block_bytes
        saved = 0.0 if fetch.estimate_s is None else fetch.estimate_s * installed / len(
            fetch.hashes) - seconds
        if fetch.waiting:  # a late fetch's blocks are counted, not its requests
            self.metrics.peer_fetch("fetched", installed, installed * block_bytes, seconds, saved)
        log.debug("fetched %d prefix blocks from %s in %.3f s", installed,
                  fetch.holder.worker_id, seconds)
        return "fetched"

    def _let_in(self, fetch: _Fetch, outcome: str) -> None:
        waiting, fetch.waiting = fetch.waiting, {}
        for req_id, request in waiting.items():
            if outcome == "fetched":
                if request.joined:
                    self.metrics.peer_fetch("joined")
            else:
                self.metrics.peer_fetch(outcome)
            self.enter(request.delivery, request.started)

    def release(self, req_id: str) -> bool:
        """Let a waiting request in now (it is being cancelled); whether it was waiting."""
        for fetch in self._fetches:
            request = fetch.waiting.pop(req_id, None)
            if request is not None:
                self.enter(request.delivery, request.started)
                return True
        return False

    def release_all(self) -> None:
        """Let every waiting request in now (a drain hands them on with the others)."""
        for fetch in self._fetches:
            self._let_in(fetch, "late")

    # ---- the holder ------------------------------------------------------------------------

    def provide(self, request_id: str) -> Outgoing | None:
        """Between two steps: a copy of the leading run of the asked blocks held here (None:
        none of them, or a malformed id)."""
        hashes = parse_prefix_id(request_id)
        if hashes is None or self.copies is None or self.copies.gap() is not None:
            return None
        state = self.copies.export(hashes)
        if state is None:
            return None
        self.metrics.served_blocks.inc(state.num_blocks)
        header, buffers = state.encode()
        return Outgoing(header, buffers)
