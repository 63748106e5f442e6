"""The worker's heartbeat (the service's second thread, worker/process/service.py): what the loop
leaves it to send, and the sending.

The service loop snapshots the engine's stats into a `Heartbeat` after every turn; this thread
writes that snapshot to Redis every heartbeat interval, with the idle time of every stream entry
held here reset (so no other worker takes them over), the drain key checked, the announced
prefix set kept listed and the worker on its model's roster; between full beats, when the
loop's running or waiting count changed, only the heartbeat hash, so the gateways' routers see
the load soon.
"""

from __future__ import annotations

import logging
import threading
import time

from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.wire import Heartbeat

log = logging.getLogger(__name__)

# the least time between two heartbeats (a change of load beats early): this share of the
# heartbeat interval, at least LOAD_BEAT_MIN_S
LOAD_BEAT_SHARE = 0.05
LOAD_BEAT_MIN_S = 0.05


class HeartbeatSender:
    """The heartbeat half of WorkerService: it reads the service's engine, metrics, protocol,
    settings, streams held, handoffs and drain, and owns `_stats_snapshot` (under `_lock`) and
    `_load_changed`, which the service creates."""

    _stats_snapshot: Heartbeat
    _lock: threading.Lock
    _load_changed: threading.Event

    def _snapshot_stats(self) -> None:
        stats, pace = self.engine.stats(), self.engine.pace_report()
        self.metrics.update_stats(stats)
        self.metrics.update_pace(pace, *self.engine.pace.take_samples(), self.engine.pace.deferred)
        beat = Heartbeat(
            model=self.protocol.model, ts=0.0,
            blocks_total=stats.num_blocks_total, blocks_free=stats.num_blocks_free,
            running=stats.num_running, waiting=stats.num_waiting,
            preemptions=stats.num_preemptions, swap_preemptions=stats.num_swap_preemptions,
            generated_tokens=stats.num_generated_tokens,
            prefix_queried_tokens=stats.prefix_queried_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            spec_draft_tokens=stats.spec_num_draft_tokens,
            spec_accepted_tokens=stats.spec_num_accepted_tokens,
            tokens_per_s=round(self.metrics.tokens_per_s(), 2), metrics_url=self.metrics_url or "",
            block_size=self.engine_block_size(), max_running=self.settings.max_running,
            model_source=self.settings.model, loras=",".join(self._lora_snapshot()),
            role=self.role, draining=int(self.drainer.active or self.drain.is_set()),
            handoff_addr=self.handoffs.addr, handoffs_out=self.handoffs.num_out,
            handoffs_in=self.handoffs.num_in, numerics=self.protocol.numerics,
            simulated=stats.simulated, sim_steps=stats.sim_steps,
            sim_lagged_steps=stats.sim_lagged_steps, **pace.heartbeat_fields())
        with self._lock:
            changed = (beat.running, beat.waiting) != (self._stats_snapshot.running,
                                                       self._stats_snapshot.waiting)
            self._stats_snapshot = beat
        if changed:
            self._load_changed.set()

    def _lora_snapshot(self) -> list[str]:
        """The adapters the engine holds, most recent first; their loads and evictions go to the
        metrics."""
        stats = self.engine.lora_stats()
        self.metrics.update_lora(stats.loads_total, stats.evictions_total, len(stats.loaded))
        return list(stats.loaded)

    def _beat(self) -> None:
        """One heartbeat: the stats snapshot, then the idle time of every held entry reset."""
        with self._lock:
            beat = self._stats_snapshot
        entries = self.inflight.held()
        self.protocol.heartbeat(beat, self.settings.heartbeat_ttl_s)
        self.protocol.refresh_pending(entries)
        if not self.drain.is_set() and self.handoffs.redis.drain_requested():
            log.info("drain requested through Redis (the admin route)")
            self.drain.set()
        if self.affinity:
            self.announcer.keep_listed()
        # on the model's roster of live workers (FleetNumerics reads it), and with several
        # shards its place there gives its home shards
        self.protocol.update_roster(self.settings.heartbeat_ttl_s)

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        """A full beat every heartbeat interval; between them, when the loop's requests running
        or waiting changed, at most every 5% of the interval (LOAD_BEAT_SHARE; at least
        LOAD_BEAT_MIN_S), only the heartbeat hash, so that the
        gateways' routers see a worker's load (gateway/fleet/affinity.py) within a fraction of the
        interval."""
        full_at = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() - full_at >= self.settings.heartbeat_interval_s:
                    full_at = time.monotonic()
                    self._beat()
                else:
                    with self._lock:
                        beat = self._stats_snapshot
                    self.protocol.heartbeat(beat, self.settings.heartbeat_ttl_s)
            except REDIS_FAILURES as exc:
                log.warning("heartbeat failed: %r", exc)
            left_s = self.settings.heartbeat_interval_s - (time.monotonic() - full_at)
            self._load_changed.wait(max(left_s, 0.0))
            self._load_changed.clear()
            stop.wait(max(LOAD_BEAT_MIN_S, LOAD_BEAT_SHARE * self.settings.heartbeat_interval_s))
