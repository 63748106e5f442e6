"""How the wire contract writes a Lua script: its source with its calling convention beside it
(what each KEYS[i] and ARGV[i] is, what it returns), field names filled in from the records that
own them, and calls checked against that convention before they reach Redis."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from string import Template
from typing import Any, NamedTuple

from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import (AskError, ClusterDownError, ConnectionError, MovedError,
                              NoScriptError, ReadOnlyError, RedisClusterException, ResponseError,
                              TimeoutError, TryAgainError)

log = logging.getLogger(__name__)

# What sends a call from a node's plain pipeline back to the cluster client, which refreshes its
# slot map and follows redirections (a failover or a resharding moved the slot, or the node left).
_REROUTE = (AskError, MovedError, TryAgainError, ClusterDownError, ConnectionError, TimeoutError,
            RedisClusterException)

CROSS_SLOT_FLAG = "#!lua flags=allow-cross-slot-keys\n"
# How a node refuses a cross-slot script's key it does not serve (the slot moved: failover,
# resharding) or a write while it is down or a replica; nothing was written by then.
_CLUSTER_STATE_REFUSAL = "Script attempted to"


class ScriptCall(NamedTuple):
    """The KEYS and ARGV of one call, in the script's order (`registered(keys=..., args=...)`)."""

    keys: list[str]
    args: list[Any]


@dataclass(frozen=True)
class LuaScript:
    """One script of the contract.

    `keys`/`argv` describe KEYS[1..]/ARGV[1..] in order; with `variadic_keys` the one entry of
    `keys` describes every key (the script loops over KEYS), with `variadic_argv` the last entry
    of `argv` describes one or more trailing arguments. On Redis Cluster all KEYS of one call must
    share a slot: giving the keys a script touches together one hash tag is the job of `Keys`,
    never of a caller.
    """

    name: str
    keys: tuple[str, ...]
    argv: tuple[str, ...]
    returns: str
    source: str
    variadic_keys: bool = False
    variadic_argv: bool = False
    # Declares no KEYS and touches keys of several slots, all on the node it is sent to: on a
    # cluster it carries Redis 7's `allow-cross-slot-keys` flag (`register`).
    cross_slot: bool = False

    @classmethod
    def build(cls, name: str, *, keys: Sequence[str], argv: Sequence[str], returns: str,
              source: str, names: Mapping[str, str] | None = None, variadic_keys: bool = False,
              variadic_argv: bool = False, cross_slot: bool = False) -> LuaScript:
        """`source` may name record fields and status values as `${name}`, filled from `names`
        (a name missing from `names` is an error here, not a bug in Redis)."""
        return cls(name, tuple(keys), tuple(argv), returns,
                   Template(source).substitute(names or {}), variadic_keys, variadic_argv,
                   cross_slot)

    def bind(self, keys: Sequence[str], args: Sequence[Any]) -> ScriptCall:
        """A call of this script; raises ValueError when it does not match the convention."""
        if not _fits(len(keys), len(self.keys), self.variadic_keys):
            raise ValueError(f"script {self.name}: {len(keys)} keys for {self.keys}")
        if not _fits(len(args), len(self.argv), self.variadic_argv):
            raise ValueError(f"script {self.name}: {len(args)} args for {self.argv}")
        return ScriptCall(list(keys), list(args))

    def register(self, client):
        """The script registered on a redis-py client (sync or asyncio): call it with
        `script(keys=call.keys, args=call.args[, client=pipeline])`; it runs by EVALSHA. A
        `cross_slot` script gets its flag on a cluster only: a single Redis needs none (and
        Redis 6 knows no flags)."""
        if self.cross_slot and isinstance(client, (RedisCluster, AsyncRedisCluster)):
            return client.register_script(CROSS_SLOT_FLAG + self.source)
        return client.register_script(self.source)


def _fits(given: int, described: int, variadic: bool) -> bool:
    """`given` values for `described` slots, the last of which repeats (once or more) when
    variadic."""
    return given >= described if variadic else given == described


def run_pipelined(client, script, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run a registered `script` once per call in one pipelined round trip (blocking client) and
    return the replies in order. A node that lacks the script (NOSCRIPT: a replica promoted by a
    cluster failover starts with an empty script cache) gets it loaded, and only the calls it
    refused run again: every call runs exactly once.

    On a cluster the calls go to each slot's primary through that node's own plain pipeline
    (`run_by_node`): redis-py's cluster pipeline would send a COMMAND GETKEYS before every
    EVALSHA. Calls that a node redirects or cannot take fall back to the cluster client's
    pipeline, which refreshes the slot map and follows the redirection."""
    if isinstance(client, RedisCluster):
        return run_by_node(client, script, calls)
    return _run_cluster_pipeline(client, script, calls)


def _group_by_node(client: RedisCluster, calls: Sequence[ScriptCall]
                   ) -> tuple[dict[str, tuple[Any, list[int]]], list[int]]:
    """Indices of `calls` by the primary owning their first key's slot ({name: (node, indices)}),
    and those whose node the slot map does not know (to go through the cluster client)."""
    by_node: dict[str, tuple[Any, list[int]]] = {}
    reroute: list[int] = []
    for i, call in enumerate(calls):
        try:
            node = client.nodes_manager.get_node_from_slot(client.keyslot(call.keys[0]))
        except _REROUTE:
            reroute.append(i)
            continue
        by_node.setdefault(node.name, (node, []))[1].append(i)
    return by_node, reroute


def run_by_node(client: RedisCluster, script, calls: Sequence[ScriptCall]) -> list[Any]:
    """`run_pipelined` on a cluster: calls grouped by the primary owning their (hash-tagged)
    slot, one plain pipeline per node. A call whose node answered MOVED/ASK/TRYAGAIN, or whose
    node failed (connection error, no node for the slot), runs again through the cluster
    client; the scripts are fenced by attempt and write the checkpoint at a fixed offset, so a
    call repeated after a lost reply changes nothing twice."""
    replies: list[Any] = [None] * len(calls)
    by_node, reroute = _group_by_node(client, calls)
    for node, indices in by_node.values():
        try:
            results = _run_on_node(client.get_redis_connection(node), script, calls, indices)
        except _REROUTE:
            reroute.extend(indices)
            continue
        for i, result in zip(indices, results):
            if isinstance(result, _REROUTE):
                reroute.append(i)
            elif isinstance(result, Exception):
                raise result
            else:
                replies[i] = result
    return _rerun_through_cluster(client, script, calls, reroute, replies)


def _rerun_through_cluster(client: RedisCluster, script, calls: Sequence[ScriptCall],
                           reroute: list[int], replies: list[Any]) -> list[Any]:
    """Fill replies[i] for the calls in `reroute` through the cluster client, after refreshing
    its slot map (it was stale, or a node is gone); returns `replies`."""
    if reroute:
        reroute.sort()
        client.nodes_manager.initialize()
        again = _run_cluster_pipeline(client, script, [calls[i] for i in reroute])
        for i, result in zip(reroute, again):
            replies[i] = result
    return replies


def _run_on_node(node_client, script, calls: Sequence[ScriptCall], indices: list[int]) -> list:
    """One node's calls through its plain pipeline, replies (or errors) in order."""
    return _evalsha_pipelined(node_client, script, [calls[i] for i in indices])


def _run_cluster_pipeline(client, script, calls: Sequence[ScriptCall]) -> list[Any]:
    """`run_pipelined` through the client's own pipeline (a single Redis, or a cluster's
    fallback)."""
    replies = _evalsha_pipelined(client, script, calls)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _evalsha_pipelined(client, script, calls: Sequence[ScriptCall]) -> list[Any]:
    """The calls as EVALSHAs in one pipeline of `client`, replies (or errors) in order; the
    script is loaded if the server lacks it, and only the refused calls run again."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            # execute_command: redis-py's cluster pipeline refuses its evalsha() method but
            # routes an EVALSHA by its keys' slot like any other command
            pipe.execute_command("EVALSHA", script.sha, len(calls[i].keys), *calls[i].keys,
                                 *calls[i].args)
        missing = []
        for i, result in zip(todo, pipe.execute(raise_on_error=False)):
            if isinstance(result, NoScriptError) and attempt == 0:
                missing.append(i)
            else:
                replies[i] = result
        if not missing:
            break
        client.script_load(script.script)
        todo = missing
    return replies


def run_per_node(client, step_script, one_script, calls: Sequence[ScriptCall]
                 ) -> tuple[list[Any], list[Any]]:
    """Run `one_script` once per call, as one call of `step_script` per node: `step_script`
    (a `cross_slot` script with no KEYS) takes the KEYS and ARGV of each call in turn as its
    ARGV and replies {{one value per call, in order}, {further values}}; `one_script` replies
    {value, {further values}}. Returns (the values by call, every reply's further values in
    one list). A single Redis gets one call for all. On a cluster the calls are grouped by the
    primary owning their slot, one call to each through its plain connection; a node that
    refuses (the slot moved, it is a replica now, it failed) sends its group back through the
    cluster client, one `one_script` call each (which refreshes the slot map and follows
    redirections). The step script reads before it writes, so a refused call wrote nothing;
    one lost with its connection may have: the scripts it batches must be idempotent, as
    PUBLISH is."""
    if not isinstance(client, RedisCluster):
        values, further = _evalsha_step(client, step_script, calls)
        return list(values), list(further)
    replies: list[Any] = [None] * len(calls)
    extras: list[Any] = []
    by_node, reroute = _group_by_node(client, calls)
    for node, indices in by_node.values():
        try:
            values, further = _evalsha_step(client.get_redis_connection(node), step_script,
                                            [calls[i] for i in indices])
        except (*_REROUTE, ResponseError) as exc:
            if (isinstance(exc, ResponseError) and not isinstance(exc, ReadOnlyError)
                    and _CLUSTER_STATE_REFUSAL not in str(exc)):
                raise
            log.debug("node %s refused a step call (%r): rerouted", node.name, exc)
            reroute.extend(indices)
            continue
        for i, value in zip(indices, values):
            replies[i] = value
        extras.extend(further)
    _rerun_through_cluster(client, one_script, calls, reroute, replies)
    for i in reroute:
        replies[i], further = replies[i]
        extras.extend(further)
    return replies, extras


def _evalsha_step(client, step_script, calls: Sequence[ScriptCall]) -> list[Any]:
    """One EVALSHA of `step_script` on `client` (a single Redis or one node) for all `calls`;
    the script is loaded if the server lacks it (a promoted replica starts with none)."""
    args = [value for call in calls for value in (*call.keys, *call.args)]
    try:
        return client.evalsha(step_script.sha, 0, *args)
    except NoScriptError:
        client.script_load(step_script.script)
        return client.evalsha(step_script.sha, 0, *args)
