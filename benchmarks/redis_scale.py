"""Redis scale benchmark: the fleet protocol on one Redis vs a 3-primary Redis Cluster, driven by
synthetic workers (WorkerProtocol, no model) and synthetic gateways (RedisEngineClient: the real
enqueue, fan-out and event stream) in separate processes, for the same time on each topology.

    .venv/bin/python -m benchmarks.redis_scale --duration-s 15 --workers 2 --gateways 2 \
        --concurrency 64 --running 64 --tokens 32 --tokens-per-event 1 --one-primary

Each synthetic worker keeps up to `--running` requests, admitted as the worker service admits
them (one READ_IF_FITS call per shard for its free room, its home shards first and the others'
entries once they waited `--steal-after-ms`, their START_ATTEMPTs in one round trip);
every step it publishes one event of `--tokens-per-event` tokens per running request
(PUBLISH_STEP: checkpoint + publish, one script call per node for the step's requests) and
finishes a request after `--tokens` tokens (final event, XACK). Each gateway keeps
`--concurrency` requests open and reads each to its final event. Reported per topology:
- token events/s and tokens/s delivered end to end (received by the gateways);
- Redis CPU per delivered event: the summed `used_cpu_sys + used_cpu_user` (INFO cpu) of every
  node over the run ÷ events delivered, and the cluster's ratio to the single Redis's;
- stream shards a worker's step published to, on average (one per primary the step's calls
  went to), and the share of requests workers took from shards not their home;
- the token events per message the gateways received (a worker step's events for one inbox
  travel as one message);
- per-primary share of token events (`cmdstat_setrange` calls, one checkpoint write per event,
  INFO commandstats: counted inside scripts too) and of requests (`cmdstat_hincrby`: one
  START_ATTEMPT per request), and of stream entries (`cmdstat_xadd`);
- the breakdown: per command (INFO commandstats summed over nodes) calls and usec per delivered
  event and usec per call, and per event the INFO stats counters of round trips
  (`total_reads_processed`), writes and bytes, and Redis's system CPU.
`--one-primary` adds a diagnostic run of a 1-primary cluster with 3 stream shards (the
cluster's protocol without the split over 3 processes); `--pin` puts every Redis node on one CPU
and the client processes on the others.

Load and how it is compared:
- `--step-ms N`: each synthetic worker step takes at least N ms, as an engine step does (0, the
  default: back to back, as fast as the Python loop goes; the machine's 2 cores then set the
  rate, and each topology runs at whatever rate its clients reach).
- `--same-load-per-node`: the cluster gets 3x the workers and gateways, so each primary carries
  what the single Redis carries (with `--step-ms`, exactly 3x the offered load): the cluster
  compared at the load per server at which one would add primaries.
- `--three-singles` (with `--same-load-per-node`): a diagnostic topology of 3 independent single
  Redis servers side by side, each with the single Redis's workers and gateways: the cluster's
  process count, machine load and load per server without cluster mode. The cluster's ratio to
  it is what cluster mode and the sharded protocol cost.
- `--repeats N`: every topology once per round, N rounds; the summary gives each topology's
  median and the median of the rounds' ratios (runs compared minutes apart).
- `--no-gateway-shares`: the gateways' shard shares off (KVFLEET_GATEWAY_SHARD_SHARES): every
  request on the shard its random id picks, as before 2026-12-02.
- `--no-gateway-inboxes`: the gateways' inboxes off (KVFLEET_GATEWAY_INBOXES): one subscription
  and one message per request on its own channel, as before 2026-12-03.
Each row also says how busy the machine's cores were over the measured time (/proc/stat), how
much of one core the Redis nodes used, and how many connections each node had.
Both topologies run without replicas (a replica's stream costs its primary CPU on both sides
alike; the failover benchmark uses replicas). The cluster runs with `--queue-shards` = 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import time

import redis

from kvfleet.shared.redis_cluster import EmbeddedCluster
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.wire import (GenerationRequest, Heartbeat, Keys, RequestStatus, SamplingParams,
                         TokenEvent)
from kvfleet.worker.protocol import Publication, WorkerProtocol

MODEL = "bench"
PREFIX = "bench:"


def pin_clients(cpus: set[int] | None) -> None:
    """`--pin`: this client process runs on `cpus` only (None: wherever the OS puts it)."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def synthetic_worker(url: str, shards: int, worker_id: str, stop_at: float, running: int,
                     tokens: int, per_event: int, steal_after_ms: int, step_ms: float,
                     out: mp.Queue, pin: set[int] | None) -> None:
    pin_clients(pin)
    keys = Keys(PREFIX, queue_shards=shards)
    client = connect(url, socket_timeout=10)
    protocol = WorkerProtocol(client, keys, MODEL, worker_id, result_ttl_s=60,
                              steal_after_ms=steal_after_ms)
    protocol.heartbeat(Heartbeat(model=MODEL, ts=0.0), 30)
    protocol.ensure_groups()
    inflight: dict[str, tuple] = {}  # req_id -> (delivery, attempt, produced)
    steps = events = stolen = step_shards = 0
    roster_at = 0.0
    next_step_at = time.monotonic()
    while time.time() < stop_at:
        if step_ms > 0:  # an engine step takes step_ms: wait for the next one to be due
            time.sleep(max(next_step_at - time.monotonic(), 0))
            next_step_at = max(next_step_at + step_ms / 1000, time.monotonic())
        if protocol.uses_homes and time.time() >= roster_at:  # as the heartbeat thread does
            protocol.update_roster(5.0)
            roster_at = time.time() + 1.0
        if len(inflight) < running:  # as the worker service admits: one read, one start
            deliveries = protocol.read_batch(1_000_000, running - len(inflight)).deliveries
            if not deliveries and not inflight:  # idle: any entry at once, as the service does
                for stream in protocol.blocking_streams():
                    if (delivery := protocol.read_new(stream, None)) is not None:
                        deliveries = [delivery]
                        break
            stolen += sum(not protocol.from_home(d) for d in deliveries)
            if deliveries:
                starts = protocol.start_attempts([d.request.req_id for d in deliveries])
                for delivery, started in zip(deliveries, starts):
                    if started is None:
                        protocol.ack(delivery.stream, delivery.entry_id)
                    else:
                        inflight[delivery.request.req_id] = (delivery, started[0], 0)
        if not inflight:
            time.sleep(0.001)
            continue
        items = []
        for req_id, (delivery, attempt, produced) in list(inflight.items()):
            new = list(range(produced, min(produced + per_event, tokens)))
            final = produced + len(new) >= tokens
            event = TokenEvent(seq=produced, attempt=attempt, token_ids=new,
                               finish_reason="length" if final else None)
            items.append(Publication(req_id, attempt, event,
                                     RequestStatus.FINISHED_LENGTH if final else None,
                                     delivery.stream, delivery.entry_id,
                                     delivery.request.reply_to))
            if final:
                del inflight[req_id]
            else:
                inflight[req_id] = (delivery, attempt, produced + len(new))
        protocol.publish(items)
        steps += 1
        events += len(items)
        step_shards += len({keys.shard_of(item.req_id) for item in items})
    protocol.remove_heartbeat()
    out.put({"worker": worker_id, "steps": steps, "events": events, "stolen": stolen,
             "step_shards": step_shards})


def synthetic_gateway(url: str, shards: int, start_at: float, stop_at: float, concurrency: int,
                      shard_shares: bool, inboxes: bool, out: mp.Queue,
                      pin: set[int] | None) -> None:
    pin_clients(pin)
    asyncio.run(_gateway(url, shards, start_at, stop_at, concurrency, shard_shares, inboxes,
                         out))


async def _gateway(url, shards, start_at, stop_at, concurrency, shard_shares, inboxes,
                   out) -> None:
    from kvfleet.gateway.fleet.redis_client import RedisEngineClient

    client = RedisEngineClient.from_url(url, Keys(PREFIX, queue_shards=shards),
                                        shard_shares=shard_shares, inboxes=inboxes,
                                        command_timeout_s=10, first_event_timeout_s=30)
    await client.start()
    counts = {"events": 0, "tokens": 0, "requests": 0, "errors": 0, "error_kinds": []}
    fanout = client.fanout
    measured = {}  # the fan-out's message and event counts over the measured time

    async def mark(at: float, name: str) -> None:
        await asyncio.sleep(max(at - time.time(), 0))
        measured[name] = (fanout.messages_received, fanout.events_received)

    marks = [asyncio.create_task(mark(start_at, "start")),
             asyncio.create_task(mark(stop_at, "stop"))]

    async def one_stream() -> None:
        while time.time() < stop_at:
            request = GenerationRequest(f"b-{client.new_request_hex('b-')}", MODEL, [1, 2, 3],
                                        SamplingParams(max_tokens=1_000_000),
                                        deadline=time.time() + 120, created=time.time())
            try:
                events = await client.submit(request)
                async for event in events:
                    if start_at <= time.time() < stop_at:
                        counts["events"] += 1
                        counts["tokens"] += len(event.token_ids)
                    if event.is_final:
                        break
                await events.aclose()
                counts["requests"] += 1
            except Exception as exc:  # noqa: BLE001 - counted, reported
                counts["errors"] += 1
                if len(counts["error_kinds"]) < 3:
                    counts["error_kinds"].append(f"{time.time() - stop_at:+.1f} s: {exc!r}"[:200])
                await asyncio.sleep(0.1)

    await asyncio.gather(*(one_stream() for _ in range(concurrency)))
    await asyncio.gather(*marks)
    counts["messages"] = measured["stop"][0] - measured["start"][0]
    counts["message_events"] = measured["stop"][1] - measured["start"][1]
    await client.close()
    out.put(counts)


# INFO stats counters summed over nodes: round trips (reads/writes processed by the event loop)
# and bytes, beside the commands they carried.
TRAFFIC = ("total_commands_processed", "total_reads_processed", "total_writes_processed",
           "total_net_input_bytes", "total_net_output_bytes")


def node_stats(ports: list[int]) -> dict[int, dict]:
    """Per node: CPU seconds, INFO stats traffic counters, and INFO commandstats as
    {command: (calls, usec)} (commands run inside scripts count too: their usec is also inside
    the script's EVALSHA usec)."""
    stats = {}
    for port in ports:
        client = redis.Redis(port=port)
        cpu = client.info("cpu")
        traffic = client.info("stats")
        commands = {name.removeprefix("cmdstat_"): (value["calls"], value["usec"])
                    for name, value in client.info("commandstats").items()}
        stats[port] = {"cpu_s": cpu["used_cpu_sys"] + cpu["used_cpu_user"],
                       "clients": client.info("clients")["connected_clients"],
                       "sys_s": cpu["used_cpu_sys"],
                       "traffic": {k: traffic.get(k, 0) for k in TRAFFIC},
                       "commands": commands}
        client.close()
    return stats


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, all cores (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def machine_busy_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How busy all cores were between two `machine_cpu` readings, percent of their capacity."""
    return round(100 * (after[0] - before[0]) / max(after[1] - before[1], 1), 1)


def stats_delta(before: dict, after: dict) -> dict:
    """`after - before` of one node's stats."""
    zero = (0, 0)
    commands = {name: (calls - before["commands"].get(name, zero)[0],
                       usec - before["commands"].get(name, zero)[1])
                for name, (calls, usec) in after["commands"].items()}
    return {"cpu_s": after["cpu_s"] - before["cpu_s"], "sys_s": after["sys_s"] - before["sys_s"],
            "traffic": {k: after["traffic"][k] - before["traffic"][k] for k in TRAFFIC},
            "commands": {name: v for name, v in commands.items() if v[0] > 0}}


def breakdown(deltas: list[dict], events: int) -> dict:
    """Commands summed over nodes: calls, usec, usec per call, calls and usec per delivered
    event; traffic counters per delivered event."""
    summed: dict[str, list[int]] = {}
    for delta in deltas:
        for name, (calls, usec) in delta["commands"].items():
            entry = summed.setdefault(name, [0, 0])
            entry[0] += calls
            entry[1] += usec
    per_event = max(events, 1)
    commands = {name: {"calls": calls, "usec": usec,
                       "usec_per_call": round(usec / max(calls, 1), 2),
                       "calls_per_event": round(calls / per_event, 3),
                       "usec_per_event": round(usec / per_event, 3)}
                for name, (calls, usec) in sorted(summed.items(), key=lambda kv: -kv[1][1])}
    traffic = {k: round(sum(d["traffic"][k] for d in deltas) / per_event, 3) for k in TRAFFIC}
    return {"commands": commands, "traffic_per_event": traffic}


def run_topology(name: str, urls: list[str], ports: list[int], shards: int, args,
                 clients_per_url: int = 1) -> dict:
    """One measured run: for each of `urls` (one Redis or one cluster; several for
    independent fleets side by side) `clients_per_url` times `--workers` synthetic workers and
    `--gateways` synthetic gateways; Redis figures summed over `ports`."""
    client_cpus = None
    if args.pin:  # every Redis node on the first CPU, every client process on the others
        cpus = sorted(os.sched_getaffinity(0))
        for port in ports:
            client = redis.Redis(port=port)
            os.sched_setaffinity(int(client.info("server")["process_id"]), {cpus[0]})
            client.close()
        client_cpus = set(cpus[1:])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    warmup_s = 2.0
    start_at = time.time() + 3.0 + warmup_s  # processes start (spawn), then warm up
    stop_at = start_at + args.duration_s
    procs = [ctx.Process(target=synthetic_worker,
                         args=(url, shards, f"w{i}", stop_at + 2, args.running, args.tokens,
                               args.tokens_per_event, args.steal_after_ms, args.step_ms, out,
                               client_cpus))
             for url in urls for i in range(args.workers * clients_per_url)]
    procs += [ctx.Process(target=synthetic_gateway,
                          args=(url, shards, start_at, stop_at, args.concurrency,
                                not args.no_gateway_shares, not args.no_gateway_inboxes, out,
                                client_cpus))
              for url in urls for _ in range(args.gateways * clients_per_url)]
    for proc in procs:
        proc.start()
    time.sleep(max(start_at - time.time(), 0))
    before, cpu_before = node_stats(ports), machine_cpu()
    time.sleep(max(stop_at - time.time(), 0))
    after, cpu_after = node_stats(ports), machine_cpu()
    results = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    gateways = [r for r in results if "tokens" in r]
    events = sum(g["events"] for g in gateways)
    delta = {port: stats_delta(before[port], after[port]) for port in ports}
    cpu_s = sum(d["cpu_s"] for d in delta.values())

    def calls(port: int, *names: str) -> int:
        return sum(delta[port]["commands"].get(name, (0, 0))[0] for name in names)

    def shares(*names: str) -> list[float]:
        total = sum(calls(p, *names) for p in ports)
        return [round(100 * calls(p, *names) / max(total, 1), 1) for p in ports]

    return {"topology": name, "nodes": len(ports), "queue_shards": shards,
            "workers": args.workers * clients_per_url * len(urls),
            "gateways": args.gateways * clients_per_url * len(urls),
            "events_per_s": round(events / args.duration_s),
            "tokens_per_s": round(sum(g["tokens"] for g in gateways) / args.duration_s),
            "requests_done": sum(g["requests"] for g in gateways),
            "errors": sum(g["errors"] for g in gateways),
            "error_kinds": [kind for g in gateways for kind in g["error_kinds"]],
            "worker_steps": sum(r.get("steps", 0) for r in results),
            "events_per_step": round(sum(r["events"] for r in results if "steps" in r)
                                     / max(sum(r.get("steps", 0) for r in results), 1), 1),
            "machine_busy_pct": machine_busy_pct(cpu_before, cpu_after),
            "redis_cpu_pct": round(100 * cpu_s / args.duration_s, 1),
            # stream shards (= primaries) a worker's step published to, on average
            "shards_per_step": round(sum(r.get("step_shards", 0) for r in results)
                                     / max(sum(r.get("steps", 0) for r in results), 1), 2),
            "stolen_pct": round(100 * sum(r.get("stolen", 0) for r in results)
                                / max(sum(g["requests"] for g in gateways), 1), 1),
            "connections_per_node": [after[port]["clients"] for port in ports],
            "redis_cpu_s": round(cpu_s, 3),
            "redis_cpu_us_per_event": round(1e6 * cpu_s / max(events, 1), 2),
            "redis_sys_us_per_event": round(1e6 * sum(d["sys_s"] for d in delta.values())
                                            / max(events, 1), 2),
            # events per message the gateways received (a step's events for one inbox travel
            # in one message; 1 with --no-gateway-inboxes)
            "events_per_message": round(sum(g["message_events"] for g in gateways)
                                        / max(sum(g["messages"] for g in gateways), 1), 2),
            "event_share_pct": shares("setrange"),  # every event writes its checkpoint
            "request_share_pct": shares("hincrby"),  # one START_ATTEMPT per request
            "stream_entry_share_pct": shares("xadd"),
            "breakdown": breakdown(list(delta.values()), events)}


def print_breakdown(rows: list[dict]) -> None:
    """Per command, per delivered event: calls and usec on each topology (summed over nodes)."""
    names = []
    for row in rows:
        names += [n for n in row["breakdown"]["commands"] if n not in names]
    head = "".join(f" | {row['topology']}: calls/ev  us/ev  us/call" for row in rows)
    print(f"{'command':28}{head}")
    for name in names:
        line = f"{name:28}"
        for row in rows:
            c = row["breakdown"]["commands"].get(name)
            line += (f" | {c['calls_per_event']:16.3f} {c['usec_per_event']:6.3f} "
                     f"{c['usec_per_call']:8.2f}" if c else f" | {'-':>16} {'-':>6} {'-':>8}")
        print(line)
    for key in TRAFFIC:
        print(f"{key + ' /ev':28}" + "".join(
            f" | {row['breakdown']['traffic_per_event'][key]:16.3f} {'':6} {'':8}"
            for row in rows))
    for key, label in (("redis_cpu_us_per_event", "Redis CPU us/ev"),
                       ("redis_sys_us_per_event", "  of which sys us/ev")):
        print(f"{label:28}" + "".join(f" | {'':16} {row[key]:6.2f} {'':8}" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64, help="open requests per gateway")
    parser.add_argument("--running", type=int, default=64, help="requests per worker")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--tokens-per-event", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=0,
                        help="each synthetic worker step takes at least this long, as an engine "
                             "step does (0: steps back to back, as fast as the worker can)")
    parser.add_argument("--steal-after-ms", type=int, default=50,
                        help="the workers' --steal-after-ms (0: no home shards)")
    parser.add_argument("--one-primary", action="store_true",
                        help="also run a 1-primary cluster (cluster mode without the split over "
                             "3 processes), `--queue-shards` 3")
    parser.add_argument("--same-load-per-node", action="store_true",
                        help="the 3-primary cluster gets 3x the workers and gateways, so each "
                             "primary carries what the single Redis carries (with --step-ms, "
                             "3x the offered load; the 1-primary diagnostic keeps 1x)")
    parser.add_argument("--three-singles", action="store_true",
                        help="diagnostic: 3 independent single Redis servers side by side, each "
                             "with the single Redis's workers and gateways (needs "
                             "--same-load-per-node): the cluster's processes without cluster "
                             "mode")
    parser.add_argument("--no-gateway-shares", action="store_true",
                        help="the gateways' KVFLEET_GATEWAY_SHARD_SHARES off: every request to "
                             "the shard its random id picks (the code before 2026-12-02)")
    parser.add_argument("--no-gateway-inboxes", action="store_true",
                        help="the gateways' KVFLEET_GATEWAY_INBOXES off: each request's events "
                             "on its own channel, one message each, one subscription per "
                             "request (the code before 2026-12-03)")
    parser.add_argument("--pin", action="store_true",
                        help="Redis nodes on one CPU, the client processes on the others")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds: every topology once per round; the summary gives medians "
                             "and the median of the rounds' ratios")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.three_singles and not args.same_load_per_node:
        parser.error("--three-singles compares with the cluster at the same load per node: "
                     "give --same-load-per-node too")
    print(f"# {platform.processor() or platform.machine()}, {mp.cpu_count()} cores, "
          f"redis-py {redis.__version__}; {vars(args)}", flush=True)
    rounds = []
    for index in range(args.repeats):
        if args.repeats > 1:
            print(f"## round {index + 1} of {args.repeats}", flush=True)
        rows = one_round(args)
        print_round(rows, args.json)
        rounds.append(rows)
    summary = summarize(rounds)
    print(json.dumps(summary) if args.json else format_summary(summary, args.repeats))


def one_round(args) -> list[dict]:
    """Every topology once, one after the other: single Redis, cluster, then the diagnostics."""
    rows = []
    with EmbeddedRedis() as single:
        rows.append(run_topology("single", [single.url], [single.port], 1, args))
    with EmbeddedCluster(num_primaries=3, replicas=0) as cluster:
        rows.append(run_topology("cluster", [cluster.url], [n.port for n in cluster.nodes], 3,
                                 args, 3 if args.same_load_per_node else 1))
    if args.one_primary:
        with EmbeddedCluster(num_primaries=1, replicas=0) as cluster:
            rows.append(run_topology("cluster1", [cluster.url], [cluster.nodes[0].port], 3,
                                     args))
    if args.three_singles:
        with EmbeddedRedis() as a, EmbeddedRedis() as b, EmbeddedRedis() as c:
            rows.append(run_topology("singles3", [a.url, b.url, c.url],
                                     [a.port, b.port, c.port], 1, args))
    return rows


def print_round(rows: list[dict], as_json: bool) -> None:
    for row in rows:
        print(json.dumps(row) if as_json else
              f"{row['topology']:8} nodes {row['nodes']} shards {row['queue_shards']} workers "
              f"{row['workers']} gateways {row['gateways']}: "
              f"{row['events_per_s']} events/s, {row['tokens_per_s']} tokens/s, "
              f"{row['requests_done']} requests, {row['errors']} errors; Redis CPU "
              f"{row['redis_cpu_us_per_event']} us/event; event share {row['event_share_pct']}, "
              f"request share {row['request_share_pct']}, stream entries "
              f"{row['stream_entry_share_pct']}; shards per worker step "
              f"{row['shards_per_step']}, events per worker step {row['events_per_step']}, "
              f"events per message {row['events_per_message']}, "
              f"stolen {row['stolen_pct']}% of requests; cores busy "
              f"{row['machine_busy_pct']}% (Redis {row['redis_cpu_pct']}% of one core); "
              f"connections per node {row['connections_per_node']}", flush=True)
    for row in rows:
        for kind in row["error_kinds"]:  # when it happened, from the end of the measured time
            print(f"{row['topology']} error at {kind}")
    if not as_json:
        print_breakdown(rows)


def summarize(rounds: list[list[dict]]) -> dict:
    """Per topology over the rounds: the median Redis CPU per event, events/s and errors in all;
    per round each topology's CPU per event divided by the single Redis's of the same round
    (`ratio_to_single`) and, with the 3-singles diagnostic, the cluster's divided by theirs;
    the median of each list of ratios (rounds compared minutes apart, not a whole run apart)."""
    names = [row["topology"] for row in rounds[0]]
    by_name = {name: [next(r for r in rows if r["topology"] == name) for rows in rounds]
               for name in names}

    def cost(row: dict) -> float:
        return row["redis_cpu_us_per_event"]

    topologies = {}
    for name, rows in by_name.items():
        ratios = [cost(row) / max(cost(single), 1e-9)
                  for row, single in zip(rows, by_name["single"])]
        topologies[name] = {
            "redis_cpu_us_per_event": [cost(row) for row in rows],
            "median_redis_cpu_us_per_event": round(statistics.median(map(cost, rows)), 2),
            "median_events_per_s": round(statistics.median(r["events_per_s"] for r in rows)),
            "errors": sum(r["errors"] for r in rows),
            "ratio_to_single": [round(r, 3) for r in ratios],
            "median_ratio_to_single": round(statistics.median(ratios), 3)}
    summary = {"rounds": len(rounds), "topologies": topologies}
    if "singles3" in by_name:
        ratios = [cost(c) / max(cost(s), 1e-9)
                  for c, s in zip(by_name["cluster"], by_name["singles3"])]
        summary["cluster_to_singles3"] = [round(r, 3) for r in ratios]
        summary["median_cluster_to_singles3"] = round(statistics.median(ratios), 3)
    return summary


def format_summary(summary: dict, repeats: int) -> str:
    lines = [f"# summary over {summary['rounds']} round(s): median Redis CPU per delivered event "
             f"(each round's figures), median of the rounds' ratios to the single Redis"]
    for name, t in summary["topologies"].items():
        figures = " / ".join(f"{v:.2f}" for v in t["redis_cpu_us_per_event"])
        lines.append(f"{name:8} {t['median_redis_cpu_us_per_event']:7.2f} us/event ({figures}); "
                     f"{t['median_events_per_s']} events/s; errors {t['errors']}; "
                     f"/ single {t['median_ratio_to_single']:.3f} "
                     f"({' / '.join(f'{r:.3f}' for r in t['ratio_to_single'])})")
    if "median_cluster_to_singles3" in summary:
        lines.append(f"cluster / singles3: {summary['median_cluster_to_singles3']:.3f} "
                     f"({' / '.join(f'{r:.3f}' for r in summary['cluster_to_singles3'])})")
    lines.append(f"cluster / single Redis CPU per event: "
                 f"{summary['topologies']['cluster']['median_ratio_to_single']:.3f}"
                 + (" (median of the rounds)" if repeats > 1 else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
