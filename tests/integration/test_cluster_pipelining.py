"""The worker's per-step script calls on a Redis Cluster go through each node's own plain
connection: no COMMAND GETKEYS (redis-py's cluster pipeline sends one per EVALSHA); a step's
publications are one PUBLISH_STEP call per node (one call in all on a single Redis, three
commands per event inside it once the first tokens are written); a call that
reaches the wrong node (a stale slot map) or a node without the script still runs exactly once."""

from __future__ import annotations

import pytest

from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import Keys, TokenEvent, decode_checkpoint, scripts
from kvfleet.shared.wire.lua import run_per_node, run_pipelined

KEYS = Keys("cp:")
REQS = [f"req-{i}" for i in range(24)]


@pytest.fixture
def cluster_client(redis_cluster):
    redis_cluster.flush()
    client = connect(redis_cluster.url)
    for req_id in REQS:  # attempt 1 of each request (before a test makes the slot map stale)
        client.hset(KEYS.request(req_id), "attempt", 1)
    yield client
    client.close()
    redis_cluster.flush()


def command_calls(client) -> dict[str, int]:
    """COMMAND (any subcommand) calls so far on each primary."""
    counts = {}
    for node in client.get_primaries():
        stats = client.get_redis_connection(node).info("commandstats")
        counts[node.name] = sum(v["calls"] for k, v in stats.items()
                                if k == "cmdstat_command" or k.startswith("cmdstat_command|"))
    return counts


def evalsha_calls(client) -> dict[str, int]:
    return {node.name: client.get_redis_connection(node).info("commandstats")
            .get("cmdstat_evalsha", {}).get("calls", 0) for node in client.get_primaries()}


def step(client, seq: int) -> list:
    calls = [scripts.publish(KEYS, req_id, 1, TokenEvent(seq=seq, attempt=1, token_ids=[seq]),
                             None, ttl_s=30, sharded=True) for req_id in REQS]
    return [accepted for accepted, undelivered in
            run_pipelined(client, scripts.PUBLISH.register(client), calls)]


def test_a_publish_step_sends_no_command_getkeys_and_spreads_over_the_nodes(cluster_client):
    step(cluster_client, 0)  # loads the script where needed
    before_command, before_evalsha = command_calls(cluster_client), evalsha_calls(cluster_client)
    assert step(cluster_client, 1) == [1] * len(REQS)
    assert command_calls(cluster_client) == before_command
    after = evalsha_calls(cluster_client)
    per_node = [after[name] - before_evalsha[name] for name in after]
    assert sum(per_node) == len(REQS) and min(per_node) > 0  # each node ran its own calls
    for req_id in REQS:
        assert decode_checkpoint(cluster_client.get(KEYS.checkpoint(req_id))) == [0, 1]


def test_nodes_without_the_script_get_it_and_run_each_call_once(cluster_client):
    for node in cluster_client.get_primaries():
        cluster_client.get_redis_connection(node).script_flush()
    assert step(cluster_client, 0) == [1] * len(REQS)
    assert step(cluster_client, 1) == [1] * len(REQS)
    for req_id in REQS:
        assert decode_checkpoint(cluster_client.get(KEYS.checkpoint(req_id))) == [0, 1]


def test_calls_sent_to_the_wrong_node_fall_back_to_the_cluster_client(cluster_client,
                                                                      monkeypatch):
    """A stale slot map (as after a failover): every node answers MOVED for the calls it does
    not own, and those calls run through the cluster client, once each."""
    step(cluster_client, 0)
    first = cluster_client.get_primaries()[0]
    manager = cluster_client.nodes_manager
    stale = {"on": True}
    real = manager.get_node_from_slot

    def wrong_node(slot, *args, **kwargs):
        return first if stale["on"] else real(slot, *args, **kwargs)

    monkeypatch.setattr(manager, "get_node_from_slot", wrong_node)
    real_initialize = manager.initialize

    def refresh(*args, **kwargs):
        stale["on"] = False
        return real_initialize(*args, **kwargs)

    monkeypatch.setattr(manager, "initialize", refresh)
    assert step(cluster_client, 1) == [1] * len(REQS)
    assert not stale["on"]  # the slot map was refreshed
    for req_id in REQS:
        assert decode_checkpoint(cluster_client.get(KEYS.checkpoint(req_id))) == [0, 1]


def spublish_calls(client) -> int:
    return sum(client.get_redis_connection(node).info("commandstats")
               .get("cmdstat_spublish", {}).get("calls", 0) for node in client.get_primaries())


def step_per_node(client, seq: int, attempts: dict[str, int] | None = None) -> list:
    calls = [scripts.publish(KEYS, req_id, (attempts or {}).get(req_id, 1),
                             TokenEvent(seq=seq, attempt=1, token_ids=[seq]), None, ttl_s=30,
                             sharded=True) for req_id in REQS]
    replies, undelivered = run_per_node(client, scripts.PUBLISH_STEP.register(client),
                                        scripts.PUBLISH.register(client), calls)
    assert undelivered == []  # each request's own channel lives on its node
    return replies


def test_a_step_is_one_call_per_node_with_each_request_published_once(cluster_client):
    step_per_node(cluster_client, 0)  # loads the script where needed
    before = evalsha_calls(cluster_client), command_calls(cluster_client)
    published = spublish_calls(cluster_client)
    stale = {REQS[3]: 7}  # an old attempt: refused, nothing written for it
    replies = step_per_node(cluster_client, 1, stale)
    assert replies == [0 if req_id in stale else 1 for req_id in REQS]
    after = evalsha_calls(cluster_client)
    assert [after[name] - before[0][name] for name in after] == [1, 1, 1]
    assert command_calls(cluster_client) == before[1]
    assert spublish_calls(cluster_client) - published == len(REQS) - 1
    for req_id in REQS:
        expected = [0] if req_id in stale else [0, 1]
        assert decode_checkpoint(cluster_client.get(KEYS.checkpoint(req_id))) == expected


def test_a_step_call_to_a_node_without_the_script_loads_it(cluster_client):
    for node in cluster_client.get_primaries():
        cluster_client.get_redis_connection(node).script_flush()
    assert step_per_node(cluster_client, 0) == [1] * len(REQS)
    assert step_per_node(cluster_client, 1) == [1] * len(REQS)
    for req_id in REQS:
        assert decode_checkpoint(cluster_client.get(KEYS.checkpoint(req_id))) == [0, 1]


def test_a_step_call_to_the_wrong_node_writes_nothing_and_is_rerouted(cluster_client,
                                                                       monkeypatch):
    """A stale slot map sends every request to one node: it refuses the keys of the slots it
    does not serve before writing anything, and those requests go through the cluster client."""
    step_per_node(cluster_client, 0)
    first = cluster_client.get_primaries()[0]
    manager = cluster_client.nodes_manager
    stale = {"on": True}
    real = manager.get_node_from_slot
    monkeypatch.setattr(manager, "get_node_from_slot", lambda slot, *a, **k:
                        first if stale["on"] else real(slot, *a, **k))
    real_initialize = manager.initialize

    def refresh(*args, **kwargs):
        stale["on"] = False
        return real_initialize(*args, **kwargs)

    monkeypatch.setattr(manager, "initialize", refresh)
    published = spublish_calls(cluster_client)
    assert step_per_node(cluster_client, 1) == [1] * len(REQS)
    assert not stale["on"]  # the slot map was refreshed
    assert spublish_calls(cluster_client) - published == len(REQS)  # each event once
    for req_id in REQS:
        assert decode_checkpoint(cluster_client.get(KEYS.checkpoint(req_id))) == [0, 1]


def commands_inside(client, step, calls) -> dict[str, int]:
    """Run one step call on a single Redis (every call accepted); the commands it ran inside."""
    client.config_resetstat()
    assert run_per_node(client, step, scripts.PUBLISH.register(client),
                        calls) == ([1] * len(REQS), [])
    return {name.removeprefix("cmdstat_"): stat["calls"]
            for name, stat in client.info("commandstats").items()
            if name not in ("cmdstat_evalsha", "cmdstat_config|resetstat")}


def test_a_step_on_a_single_redis_is_one_call(redis_server):
    redis_server.flush()
    client = connect(redis_server.url)
    try:
        for req_id in REQS:
            client.hset(KEYS.request(req_id), "attempt", 1)
        calls = [scripts.publish(KEYS, req_id, 1, TokenEvent(seq=0, attempt=1, token_ids=[5]),
                                 None, ttl_s=30, sharded=False) for req_id in REQS]
        step = scripts.PUBLISH_STEP.register(client)
        client.script_load(step.script)
        client.config_resetstat()
        assert run_per_node(client, step, scripts.PUBLISH.register(client),
                            calls) == ([1] * len(REQS), [])
        stats = client.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert stats["cmdstat_publish"]["calls"] == len(REQS)
        assert all(decode_checkpoint(client.get(KEYS.checkpoint(r))) == [5] for r in REQS)
        # a later step: three commands per event (attempt check, checkpoint write, publish)
        calls = [scripts.publish(KEYS, req_id, 1, TokenEvent(seq=1, attempt=1, token_ids=[6]),
                                 None, ttl_s=30, sharded=False) for req_id in REQS]
        assert commands_inside(client, step, calls) == {
            "hmget": len(REQS), "setrange": len(REQS), "publish": len(REQS)}
        assert all(decode_checkpoint(client.get(KEYS.checkpoint(r))) == [5, 6] for r in REQS)
        # requests that name one inbox: two commands per event and one publish for the step
        calls = [scripts.publish(KEYS, req_id, 1, TokenEvent(seq=2, attempt=1, token_ids=[7]),
                                 None, ttl_s=30, sharded=False, reply_to=KEYS.inbox("gw"))
                 for req_id in REQS]
        assert commands_inside(client, step, calls) == {
            "hmget": len(REQS), "setrange": len(REQS), "publish": 1}
        assert all(decode_checkpoint(client.get(KEYS.checkpoint(r))) == [5, 6, 7] for r in REQS)
    finally:
        client.close()
        redis_server.flush()
