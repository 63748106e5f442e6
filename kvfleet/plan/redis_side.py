"""The Redis side of a plan: how many cluster primaries (and stream shards), gateway processes and
connections the demand needs, from measured per-event costs (docs/BENCHMARKS.md, "Redis
Cluster scale": Redis CPU per delivered token event; "Gateway under load": events/s one gateway
process delivers).

A Redis primary is one core (Redis runs commands on one thread), so one primary carries
1e6 / (µs of Redis CPU per event) events/s at full load; the plan runs each at `headroom` of that.
An event carries `tokens_per_event` tokens (one per request per worker step; more when workers
coalesce steps with `--publish-interval-ms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Measured defaults (docs/BENCHMARKS.md, see the module docstring): Redis CPU per event on the
# 3-primary cluster with gateway inboxes at a single Redis's load per primary (the costlier of
# its flat-out and same-load figures).
DEFAULT_REDIS_US_PER_EVENT = 24.0
DEFAULT_GATEWAY_EVENTS_PER_S = 1000.0
DEFAULT_HEADROOM = 0.5
DEFAULT_REQUESTS_PER_S = 5787.0  # the brief's 500M requests/day


@dataclass(frozen=True)
class RedisInputs:
    demand_tokens_per_s: float
    requests_per_s: float
    gpus: int
    tokens_per_event: int = 1
    redis_us_per_event: float = DEFAULT_REDIS_US_PER_EVENT
    gateway_events_per_s: float = DEFAULT_GATEWAY_EVENTS_PER_S
    headroom: float = DEFAULT_HEADROOM


@dataclass(frozen=True)
class RedisPlan:
    events_per_s: float
    events_per_s_per_primary: float  # at the headroom
    primaries: int  # = stream shards per model (--queue-shards)
    replicas: int  # one per primary, for failover
    gateways: int
    gateway_pubsub_connections: int  # each gateway: one sharded subscription per primary
    worker_connections: int  # each worker: one per primary (its keys span every slot)
    connections_per_primary: int  # pub/sub + command connections, about
    requests_per_s_per_primary: float


def plan_redis(inputs: RedisInputs) -> RedisPlan:
    events_per_s = inputs.demand_tokens_per_s / inputs.tokens_per_event
    per_primary = 1e6 / inputs.redis_us_per_event * inputs.headroom
    primaries = max(1, math.ceil(events_per_s / per_primary))
    gateways = max(1, math.ceil(events_per_s / (inputs.gateway_events_per_s * inputs.headroom)))
    gateway_pubsub = gateways * primaries if primaries > 1 else gateways
    worker_connections = inputs.gpus * primaries
    # per primary: each gateway's subscription and its command connection, each worker's
    # command connection, each worker's cancel subscription on the one cancel slot spread out
    per_primary_connections = 2 * gateways + inputs.gpus + math.ceil(inputs.gpus / primaries)
    return RedisPlan(events_per_s, per_primary, primaries, primaries, gateways, gateway_pubsub,
                     worker_connections, per_primary_connections,
                     inputs.requests_per_s / primaries)


def redis_plan_text(plan: RedisPlan, inputs: RedisInputs) -> str:
    lines = [
        "Redis (cluster)",
        f"  token events/s          {plan.events_per_s:,.0f} ({inputs.tokens_per_event} token(s) "
        f"per event)",
        f"  per primary             {plan.events_per_s_per_primary:,.0f} events/s "
        f"({inputs.redis_us_per_event:g} µs Redis CPU per event, {inputs.headroom:.0%} headroom)",
        f"  primaries               {plan.primaries} (+ {plan.replicas} replicas); "
        f"--queue-shards {plan.primaries}",
        f"  requests/s per primary  {plan.requests_per_s_per_primary:,.0f}",
        f"  gateway processes       {plan.gateways} (at {inputs.gateway_events_per_s:,.0f} "
        f"events/s each, {inputs.headroom:.0%} headroom)",
        f"  connections             gateways' pub/sub {plan.gateway_pubsub_connections:,}; "
        f"workers' {plan.worker_connections:,}; about {plan.connections_per_primary:,} per "
        f"primary",
    ]
    if plan.primaries == 1:
        lines.append("  one Redis carries it: no cluster needed (--queue-shards 1)")
    return "\n".join(lines) + "\n"


def redis_plan_json(plan: RedisPlan) -> dict:
    return {field: getattr(plan, field) for field in plan.__dataclass_fields__}
