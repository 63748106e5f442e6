"""Prefix-affinity routing through real processes, at the default routing (`affinity`): the next
turn of a conversation goes to the worker that served the last one and finds its history there,
whichever worker that was (docs/ARCHITECTURE.md, "Prefix-affinity routing")."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.wire import Heartbeat, RequestRecord

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Four tenants with system prompts of a few hundred tokens each, so that a conversation's history
# spans many KV blocks and a worker that lacks it recomputes most of the prompt.
TENANTS = ["a lighthouse keeper's logbook", "a railway timetable office", "a beekeeping guild",
           "a harbour pilot service"]


def system_prompt(tenant: str) -> str:
    rules = " ".join(f"Rule {i}: when asked about {tenant}, answer in one calm, short sentence "
                     f"and never repeat rule {i}." for i in range(1, 13))
    return f"You are the assistant of {tenant}. {rules}"


def chat(url: str, messages: list[dict], out: dict) -> None:
    body = {"model": DEFAULT_MODEL, "messages": messages, "temperature": 0, "max_tokens": 12}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    out["response"] = response.json()


def served_by(client: redis.Redis, fleet, completion: dict) -> str:
    """The worker of the request's last attempt (the completion id is the request id)."""
    worker = client.hget(fleet.keys.request(completion["id"]), RequestRecord.WORKER)
    return worker.decode()


def wait_until_idle(client: redis.Redis, fleet, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [Heartbeat.decode(client.hgetall(fleet.keys.worker(w))) for w in fleet.workers]
        if all(b.running == 0 and b.waiting == 0 for b in beats):
            time.sleep(0.3)  # the gateway reads heartbeats every 0.1 s
            return
        time.sleep(0.05)
    raise AssertionError("the workers never went idle")


def test_a_conversations_next_turn_follows_its_cache(fleet):
    client = redis.Redis.from_url(fleet.redis_url)
    try:
        conversations = [[{"role": "system", "content": system_prompt(t)},
                          {"role": "user", "content": f"Who are you, {t}?"}] for t in TENANTS]
        # Turn 1 of every conversation at once: the shared streams spread them over the workers.
        firsts = [dict() for _ in conversations]
        threads = [threading.Thread(target=chat, args=(fleet.url, c, o))
                   for c, o in zip(conversations, firsts)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        # Turn 2, one after the other, once the workers' heartbeats say they are idle (and the
        # gateway has read them): load never outweighs the cache here.
        wait_until_idle(client, fleet)
        for messages, first in zip(conversations, firsts):
            answer = first["response"]["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "And what do you do all day?"}]
            second: dict = {}
            chat(fleet.url, messages, second)
            turn1, turn2 = first["response"], second["response"]
            assert served_by(client, fleet, turn2) == served_by(client, fleet, turn1)
            # Everything up to the first turn's answer was cached on that worker: at least the
            # first turn's prompt, less the part of a block the cache does not share.
            cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= turn1["usage"]["prompt_tokens"] - 64, (cached, turn1["usage"])
    finally:
        client.close()
