"""The fleet's capacity at the promised pace, from the live workers' heartbeats (one model's).

Each worker publishes how many more streams it takes now and still keeps its `--target-itl-ms`
(`pace_room`, -1 when it promises no pace) and how many it runs at that pace with its current
mix (`pace_streams`). Backpressure reads the room (a request that fits in it starts at once),
the autoscaling metric the per-worker streams (how many workers the queue needs). Workers that
promise no pace fall back to their `max_running`: the most they run at once, pace or not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet.gateway.fleet.load import takes_new_requests
from kvfleet.shared.wire import Heartbeat


@dataclass(frozen=True)
class FleetPace:
    """What one model's live workers say of their capacity at the pace they promise."""

    live_workers: int
    promised: bool  # some live worker promises a pace (pace_room >= 0)
    room: int  # more streams the workers taking new requests start now at their pace
    streams: int  # streams the live workers hold: running plus admitted, waiting to run
    streams_per_worker: float  # mean pace_streams of the workers promising a pace, else of
    # max_running (0: no live worker, or none says)

    def workers_needed(self, undelivered: int) -> int:
        """Workers that run the held streams plus the `undelivered` queue at the pace: 0 for no
        demand; 1 for some with no live worker (a fleet scaled to zero starts one, whose
        heartbeat then tells its capacity); a worker that states none counts as one stream."""
        demand = self.streams + max(undelivered, 0)
        if demand == 0:
            return 0
        if self.live_workers == 0:
            return 1
        return math.ceil(demand / max(self.streams_per_worker, 1.0))


def fleet_pace(beats: Iterable[Heartbeat], model: str) -> FleetPace:
    """The capacity of `model`'s live workers (draining ones hold streams but start none)."""
    mine = [beat for beat in beats if beat.model == model]
    pacers = [beat for beat in mine if beat.pace_room >= 0]
    capacities = ([beat.pace_streams for beat in pacers] if pacers
                  else [beat.max_running for beat in mine])
    return FleetPace(
        live_workers=len(mine),
        promised=bool(pacers),
        room=sum(max(beat.pace_room, 0) for beat in mine if takes_new_requests(beat)),
        streams=sum(max(beat.running, 0) + max(beat.waiting, 0) for beat in mine),
        streams_per_worker=(sum(max(c, 0) for c in capacities) / len(capacities)
                            if capacities else 0.0))
