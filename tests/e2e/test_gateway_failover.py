"""Chaos: SIGKILL the gateway in the middle of a streamed answer. The worker goes on generating;
the client counts the tokens it got (one logprobs entry per token), re-attaches through a
restarted gateway with `GET /v1/requests/{id}/stream?after=N`, and ends with exactly the text of
an uninterrupted run: nothing lost, nothing repeated."""

from __future__ import annotations

import json

import httpx
import pytest

from kvfleet.shared.models import DEFAULT_MODEL
from tests.helpers.processes import ProcessFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 120
KILL_AFTER_TOKENS = 20


def chat_body() -> dict:
    return {"model": DEFAULT_MODEL, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}]}


def read_chat(response: httpx.Response, on_tokens=None) -> tuple[str, str, int, str | None]:
    """(request id, text, tokens, finish reason) of a chat stream, as far as it goes."""
    req_id, pieces, tokens, finish = "", [], 0, None
    try:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            req_id = req_id or chunk["id"]
            for choice in chunk["choices"]:
                pieces.append(choice["delta"].get("content") or "")
                tokens += len((choice.get("logprobs") or {}).get("content") or [])
                finish = choice.get("finish_reason") or finish
            if on_tokens is not None:
                on_tokens(tokens)
    except httpx.HTTPError:  # the gateway died under us
        pass
    return req_id, "".join(pieces), tokens, finish


def test_a_killed_gateway_loses_and_repeats_nothing(redis_server, tmp_path):
    fleet = ProcessFleet(redis_server.url, tmp_path,
                         worker_flags=["--kv-memory", "256MiB", "--num-threads", "1"])
    try:
        fleet.start("w0")
        with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", json=chat_body(),
                          timeout=300) as response:
            _, reference, reference_tokens, finish = read_chat(response)
        assert (reference_tokens, finish) == (MAX_TOKENS, "length")

        victim = fleet.gateway

        def kill_midway(tokens: int) -> None:
            if tokens >= KILL_AFTER_TOKENS and victim.popen.poll() is None:
                victim.kill()  # SIGKILL: no cancel reaches the worker

        with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", json=chat_body(),
                          timeout=300) as response:
            req_id, before, received, finish = read_chat(response, kill_midway)
        assert victim.popen.returncode == -9
        assert finish is None and KILL_AFTER_TOKENS <= received < MAX_TOKENS

        fleet.start_gateway()  # a new gateway process on the same address
        after_chunks = []
        with httpx.stream("GET", f"{fleet.url}/v1/requests/{req_id}/stream",
                          params={"after": received}, timeout=300) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    after_chunks.append(json.loads(line[6:])["choices"][0])
                elif line == "data: [DONE]":
                    after_chunks.append("[DONE]")
        assert after_chunks[-1] == "[DONE]"
        chunks = after_chunks[:-1]
        assert chunks[0]["token_index"] == received  # resumes exactly where the client was
        indices = [c["token_index"] for c in chunks]
        lengths = [len(c["token_ids"]) for c in chunks]
        assert all(i + n == j for i, n, j in zip(indices, lengths, indices[1:]))  # no gap/repeat
        assert received + sum(lengths) == MAX_TOKENS
        assert chunks[-1]["finish_reason"] == "length"
        assert before + "".join(c["text"] for c in chunks) == reference
    finally:
        fleet.kill()
