"""The worker's step script alone: Redis CPU per request of one PUBLISH_STEP call (attempt check,
checkpoint write, one message per reply channel), on a single Redis and on each primary of a
3-primary cluster, nothing else running against them.

    .venv/bin/python -m benchmarks.publish_step --requests 62 --steps 400

Each step publishes one token for each of `--requests` requests (attempt 1, all naming one inbox
per primary, as a gateway's requests do), through WorkerProtocol.publish (PUBLISH_STEP, one call
per node). Reported per topology: INFO commandstats `evalsha` usec per call and per request, the
inner commands' usec per request (HMGET, SETRANGE, PUBLISH...), and the client's wall time per
step. Redis CPU here is what one event costs a primary inside the script; the fleet's per-event
figure (benchmarks/redis_scale.py) adds admission, enqueue, acks and the event loop.
"""

from __future__ import annotations

import argparse
import platform
import time

import redis
from redis.crc import key_slot

from kvfleet.shared.redis_cluster import EmbeddedCluster
from kvfleet.shared.redis_connect import connect, is_cluster
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.wire import Keys, RequestStatus, TokenEvent
from kvfleet.worker.protocol import Publication, WorkerProtocol

KEYS = Keys("pb:")


def inbox_for(client, req_id: str) -> str:
    """The inbox a gateway would name: on a cluster, one on the primary of the request's slot."""
    if not is_cluster(client):
        return KEYS.inbox("gw")
    node = client.nodes_manager.get_node_from_slot(key_slot(KEYS.request(req_id).encode())).name
    return next(KEYS.inbox("gw", part) for part in range(4096)
                if client.nodes_manager.get_node_from_slot(
                    key_slot(KEYS.inbox("gw", part).encode())).name == node)


def measure(url: str, ports: list[int], requests: int, steps: int) -> dict:
    client = connect(url)
    ids = [f"cmpl-{i:032x}" for i in range(requests)]
    inboxes = {req_id: inbox_for(client, req_id) for req_id in ids}
    for req_id in ids:
        client.hset(KEYS.request(req_id), "attempt", 1)
    protocol = WorkerProtocol(client, KEYS, "m", "w1")

    def step(seq: int) -> None:
        protocol.publish([Publication(r, 1, TokenEvent(seq=seq, attempt=1, token_ids=[seq]),
                                      None if seq < steps else RequestStatus.FINISHED_LENGTH,
                                      "", "", inboxes[r]) for r in ids])

    step(0)  # loads the script
    nodes = [redis.Redis(port=port) for port in ports]
    for node in nodes:
        node.config_resetstat()
    started = time.perf_counter()
    for seq in range(1, steps + 1):
        step(seq)
    wall_s = time.perf_counter() - started
    stats = [node.info("commandstats") for node in nodes]
    evalsha = [s.get("cmdstat_evalsha", {"calls": 0, "usec": 0}) for s in stats]
    calls, usec = sum(e["calls"] for e in evalsha), sum(e["usec"] for e in evalsha)
    inner = sum(v["usec"] for s in stats for k, v in s.items()
                if k not in ("cmdstat_evalsha", "cmdstat_config|resetstat"))
    for node in nodes:
        node.close()
    client.close()
    events = requests * steps
    return {"evalsha_calls_per_step": calls / steps, "usec_per_call": usec / max(calls, 1),
            "usec_per_request": usec / events, "inner_usec_per_request": inner / events,
            "wall_ms_per_step": 1e3 * wall_s / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=62, help="requests per step")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, redis-py {redis.__version__}; "
          f"{vars(args)}")
    with EmbeddedRedis() as single:
        rows = [("single", measure(single.url, [single.port], args.requests, args.steps))]
    with EmbeddedCluster(num_primaries=3, replicas=0) as cluster:
        rows.append(("cluster", measure(cluster.url, [n.port for n in cluster.nodes],
                                        args.requests, args.steps)))
    for name, row in rows:
        print(f"{name:8} evalsha calls per step {row['evalsha_calls_per_step']:.2f}, "
              f"{row['usec_per_call']:.1f} us per call, {row['usec_per_request']:.2f} us per "
              f"request (inner commands {row['inner_usec_per_request']:.2f}); client "
              f"{row['wall_ms_per_step']:.2f} ms per step")


if __name__ == "__main__":
    main()
