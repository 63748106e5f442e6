"""A worker's announcements of its prefix cache (`--routing affinity`): what the cache stored and
evicted, with each block's tier (device, or the host tier of `--kv-offloading-size`), sent after
every loop turn that changed it (ANNOUNCE_BLOCKS), the whole cache (both tiers) at every
(re)connect, and the set kept listed by the heartbeat thread.

Only the loop thread announces (only it drains the engine's record of changes); the heartbeat
thread only keeps the announced set listed, and asks the loop to announce it whole again
(`resync`) when it finds the set gone from Redis.
"""

from __future__ import annotations

from kvfleet.worker.engine.memory.block_manager import NetChange


class PrefixAnnouncer:
    """Announces one engine's prefix cache through one worker's protocol."""

    def __init__(self, engine, protocol, metrics, ttl_s: float):
        self.engine, self.protocol, self.metrics, self.ttl_s = engine, protocol, metrics, ttl_s
        self._unannounced = NetChange()  # the cache's changes not yet announced
        # whether this process announced its whole cache since it last (re)connected (until
        # then the heartbeat thread does not refresh the set)
        self._announced = False
        self._indexed = 0  # the size of the announced set as the loop's last announcement left it
        self.resync = False  # set by the heartbeat thread: Redis lost the set, announce it all

    def announce(self) -> None:
        """The loop's turn: the whole cache when Redis lost it, else what the prefix cache
        stored and evicted since the last announcement (what a failed call did not send stays
        and merges into the next)."""
        if self.resync:
            self.announce_all()
            return
        self._unannounced.merge(self.engine.drain_block_announcements())
        if not self._unannounced:
            return
        self._send(*self._unannounced.peek(), clear=False)
        self._unannounced.drain()

    def announce_all(self) -> None:
        """At a (re)connect: the whole cache, replacing whatever Redis holds (a process's first
        announcement; after an outage Redis may have lost or missed some)."""
        self._announced = self.resync = False
        self.engine.drain_block_announcements()  # the whole cache covers every change so far
        self._unannounced.drain()
        host = self.engine.block_manager.host_hashes()
        self._send(self.engine.cached_block_hashes() + host, [], host, clear=True)
        self._announced = True

    def keep_listed(self) -> None:
        """The heartbeat thread's part: stay listed with the set the loop announced; a set found
        gone (this thread stalled past its TTL, or Redis lost it) makes the loop resync."""
        if not self._announced:
            return
        indexed = self.protocol.announce([], [], [], clear=False, ttl_s=self.ttl_s)
        self.metrics.indexed_blocks.set(indexed)
        if indexed == 0 and self._indexed > 0:
            self.resync = True

    def _send(self, stored: list[bytes], removed: list[bytes], host: list[bytes],
              clear: bool) -> None:
        indexed = self.protocol.announce(stored, removed, host, clear=clear, ttl_s=self.ttl_s)
        self.metrics.blocks_announced(len(stored), len(removed), indexed, len(host))
        self._indexed = indexed
