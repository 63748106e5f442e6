"""An oversized upload gets its 413 over real HTTP (issue 53): the gateway, served by uvicorn on
a loopback port, reads and discards the body before it answers, so a client that sends its whole
body before reading (http.client, urllib) reads the 413 instead of a reset connection."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import uvicorn

from gateway.admission import body_limit
from gateway.app import create_app
from shared.redis_server import free_port
from shared.settings import GatewaySettings
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL

LIMIT = 1_000_000  # --max-body-bytes's default
TRIES = 20
BIG = json.dumps({"model": MODEL, "prompt": "x" * 3_000_000}).encode()  # 3 MB


@pytest.fixture(params=["httptools", "h11"])  # uvicorn's default (uvicorn[standard]), its other
async def served(request, tokenizer, model_info):
    settings = GatewaySettings(redis_url="redis://127.0.0.1:1/0", model=MODEL,
                               max_body_bytes=LIMIT)
    app = create_app(settings, FakeEngineClient(), tokenizer, model_info=model_info)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=request.param))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield port
    server.should_exit = True
    await asyncio.wait_for(task, 10)


def assert_413(status: int, body: bytes) -> None:
    assert status == 413, body[:200]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert str(LIMIT) in error["message"]


def post(port: int, body, headers: dict[str, str]) -> tuple[int, bytes]:
    """One request on a fresh connection, as http.client sends it: the headers, then the whole
    body with sendall (a bytes body with Content-Length; an iterable one chunked), then reads."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def chunks(payload: bytes, size: int = 64 * 1024):
    for start in range(0, len(payload), size):
        yield payload[start:start + size]


@pytest.mark.parametrize("connection", ["close", "keep-alive"])
async def test_a_3mb_body_gets_the_413_every_time(served, connection):
    """Connection: close is urllib's and where the reset was (the server closed at once)."""
    def tries() -> list[tuple[int, bytes]]:
        return [post(served, BIG, {"Connection": connection}) for _ in range(TRIES)]
    for status, body in await asyncio.to_thread(tries):
        assert_413(status, body)


async def test_a_chunked_upload_past_the_limit_gets_the_413_every_time(served):
    def tries() -> list[tuple[int, bytes]]:
        return [post(served, chunks(BIG), {"Connection": "close"}) for _ in range(TRIES)]
    for status, body in await asyncio.to_thread(tries):
        assert_413(status, body)


async def test_urllib_reads_the_413(served):
    def tries() -> list[tuple[int, bytes]]:
        answers = []
        for _ in range(5):
            request = urllib.request.Request(f"http://127.0.0.1:{served}/v1/completions",
                                             data=BIG,
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=10)
            answers.append((caught.value.code, caught.value.read()))
        return answers
    for status, body in await asyncio.to_thread(tries):
        assert_413(status, body)


def raw(port: int, head: bytes, body: bytes = b"") -> tuple[bytes, bytes, float]:
    """Sends `head` (and `body`), then reads until the server closes: (head, body, seconds)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    head, _, payload = answer.partition(b"\r\n\r\n")
    return head.lower(), payload, time.monotonic() - started


async def test_a_drained_413_keeps_the_connection(served):
    """The body was read to its end: the next request on the same connection is served."""
    def two_requests() -> tuple[int, bytes, int]:
        connection = http.client.HTTPConnection("127.0.0.1", served, timeout=10)
        try:
            connection.request("POST", "/v1/completions", body=BIG,
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            first = response.status, response.read()
            connection.request("GET", "/health")
            health = connection.getresponse()
            health.read()
            return *first, health.status
        finally:
            connection.close()
    status, body, health = await asyncio.to_thread(two_requests)
    assert_413(status, body)
    assert health == 200


async def test_beyond_the_bound_the_413_comes_at_once_and_closes(served, monkeypatch):
    """A declared length over DRAIN_MAX_BYTES, or one waiting for 100 Continue, is not waited
    for; a chunked upload that stalls is waited for DRAIN_MAX_S. Each gets the 413 with
    Connection: close (nothing more of the upload is sent here, so no reset)."""
    monkeypatch.setattr(body_limit, "DRAIN_MAX_S", 0.3)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    huge = request + b"Content-Length: %d\r\n\r\n" % (body_limit.DRAIN_MAX_BYTES + 1)
    expect = request + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(BIG)
    first = next(chunks(BIG, LIMIT + 1))
    stalled = (request + b"Transfer-Encoding: chunked\r\n\r\n",
               b"%x\r\n" % len(first) + first + b"\r\n")  # and never the last chunk
    for head, body in ((huge, b""), (expect, b""), stalled):
        answer_head, payload, seconds = await asyncio.to_thread(raw, served, head, body)
        assert answer_head.startswith(b"http/1.1 413"), answer_head
        assert b"100 continue" not in answer_head
        assert b"connection: close" in answer_head
        assert_413(413, payload)
        assert seconds < 5
