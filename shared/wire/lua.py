"""How the wire contract writes a Lua script: its source with its calling convention beside it
(what each KEYS[i] and ARGV[i] is, what it returns), field names filled in from the records that
own them, and calls checked against that convention before they reach Redis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from string import Template
from typing import Any, NamedTuple

from redis.exceptions import NoScriptError


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

    @classmethod
    def build(cls, name: str, *, keys: Sequence[str], argv: Sequence[str], returns: str,
              source: str, names: Mapping[str, str] | None = None,
              variadic_keys: bool = False, variadic_argv: bool = False) -> LuaScript:
        """`source` may name record fields and status values as `${name}`, filled from `names`
        (a name missing from `names` is an error here, not a bug in Redis)."""
        return cls(name, tuple(keys), tuple(argv), returns,
                   Template(source).substitute(names or {}), variadic_keys, variadic_argv)

    def bind(self, keys: Sequence[str], args: Sequence[Any]) -> ScriptCall:
        """A call of this script; raises ValueError when it does not match the convention."""
        if not _fits(len(keys), len(self.keys), self.variadic_keys):
            raise ValueError(f"script {self.name}: {len(keys)} keys for {self.keys}")
        if not _fits(len(args), len(self.argv), self.variadic_argv):
            raise ValueError(f"script {self.name}: {len(args)} args for {self.argv}")
        return ScriptCall(list(keys), list(args))

    def register(self, client):
        """The script registered on a redis-py client (sync or asyncio): call it with
        `script(keys=call.keys, args=call.args[, client=pipeline])`; it runs by EVALSHA."""
        return client.register_script(self.source)


def _fits(given: int, described: int, variadic: bool) -> bool:
    """`given` values for `described` slots, the last of which repeats (once or more) when
    variadic."""
    return given >= described if variadic else given == described


def run_pipelined(client, script, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run a registered `script` once per call in one pipelined round trip (blocking client) and
    return the replies in order. A node that lacks the script (NOSCRIPT: a replica promoted by a
    cluster failover starts with an empty script cache) gets it loaded, and only the calls it
    refused run again: every call runs exactly once."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            # execute_command: redis-py's cluster pipeline refuses its evalsha() method but
            # routes an EVALSHA by its keys' slot like any other command
            pipe.execute_command("EVALSHA", script.sha, len(calls[i].keys), *calls[i].keys,
                                 *calls[i].args)
        results = pipe.execute(raise_on_error=False)
        missing = []
        for i, result in zip(todo, results):
            if isinstance(result, NoScriptError) and attempt == 0:
                missing.append(i)
            elif isinstance(result, Exception):
                raise result
            else:
                replies[i] = result
        if not missing:
            break
        client.script_load(script.script)
        todo = missing
    return replies
