"""Which stream shards a gateway's new requests go to. Its place among the live gateways (the
ROSTER script over Keys.gateway_roster, renewed every second) gives it shares of the shards
(`gateway_shard_shares`), and it draws each new request id until the id's keys land on the shard
a weighted draw picked. On a Redis Cluster a gateway then enqueues, subscribes and receives
events on as few primaries as balance allows (one each when the gateways are a multiple of the
shards), so every primary serves a few gateways' traffic in large batches instead of every
gateway's in small ones; the home shards of the workers (worker/protocol.py) do the same for the
workers' side. With one shard (a single Redis) nothing is kept: any id will do."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

from kvfleet.gateway.fleet.tasks import cancel_requested
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.wire import Keys
from kvfleet.shared.wire import scripts

log = logging.getLogger(__name__)

# Draws of a request id before one lands on the picked shard: each lands there with probability
# 1/shards, so 64 per shard fail together about once in e^64; the last draw is taken then.
DRAWS_PER_SHARD = 64


class GatewayHomes:
    """This gateway's place on the gateway roster and the shard shares it gives."""

    def __init__(self, redis, keys: Keys, gateway_id: str | None = None, *,
                 ttl_s: float = 5.0, command_timeout_s: float = 3.0,
                 rng: random.Random | None = None):
        self.keys = keys
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self.ttl_s = ttl_s
        self._timeout_s = command_timeout_s
        self._roster = scripts.ROSTER.register(redis)
        self._rng = rng or random.Random()
        self.place: tuple[int, int] = (-1, 0)  # (index, gateways on the roster); -1: unknown
        self.shares = scripts.gateway_shard_shares(-1, 0, keys.queue_shards)
        self._joined = False

    @property
    def enabled(self) -> bool:
        """Shares matter only with several stream shards."""
        return self.keys.queue_shards > 1

    async def update(self, join: bool = True) -> bool:
        """Stay on (or leave) the roster and take the shares of this gateway's place; False when
        Redis did not answer (the last shares stay)."""
        call = scripts.gateway_roster(self.keys, self.gateway_id, int(self.ttl_s * 1000), join)
        try:
            async with asyncio.timeout(self._timeout_s):
                index, count = (int(v) for v in await self._roster(keys=call.keys,
                                                                   args=call.args))
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            log.debug("could not renew this gateway's place on the roster: %r", exc)
            return False
        self._joined = join
        moved = (index, count) != self.place
        self.place = (index, count)
        self.shares = scripts.gateway_shard_shares(index, count, self.keys.queue_shards)
        if moved:
            log.info("gateway %s is %d of %d live gateways: new requests to shards %s",
                     self.gateway_id, index, count,
                     ", ".join(f"{s} ({share:.0%})" for s, share in self.shares))
        return True

    async def run(self) -> None:
        """Renew the place until cancelled, four times per TTL."""
        while True:
            try:
                await self.update()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one failure
                # (redis-py's cluster client has raised RuntimeError while rebuilding its node
                # map after a failover): a task that died would leave this gateway off the
                # roster while it kept sending to its old shares
                log.warning("gateway roster update failed: %r", exc)
            if cancel_requested():  # a cancel redis-py swallowed (gateway/fleet/tasks.py)
                raise asyncio.CancelledError
            await asyncio.sleep(self.ttl_s / 4)

    async def leave(self) -> None:
        if self._joined:
            await self.update(join=False)

    def pick_shard(self) -> int:
        """A shard for the next request, drawn by this gateway's shares."""
        shards, weights = zip(*self.shares)
        return self._rng.choices(shards, weights)[0]

    def request_hex(self, prefix: str) -> str:
        """A random hex id whose request id `prefix + hex` lives on a shard drawn by the shares
        (any shard with a single one)."""
        if not self.enabled:
            return uuid.uuid4().hex
        shard = self.pick_shard()
        for _ in range(DRAWS_PER_SHARD * self.keys.queue_shards):
            candidate = uuid.uuid4().hex
            if self.keys.shard_of(prefix + candidate) == shard:
                break
        return candidate
