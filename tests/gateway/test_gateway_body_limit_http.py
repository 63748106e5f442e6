"""An oversized upload gets its 413 over real HTTP (issue 53): the gateway, served by uvicorn on
a loopback port, reads and discards the body before it answers, so a client that sends its whole
body before reading (http.client, urllib) reads the 413 instead of a reset connection. So does
every other answer sent before the body was read (gateway/admission/early_answer.py): the API
key's 401, the app's 404 and 405."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import uvicorn

from kvfleet.gateway.admission import early_answer
from kvfleet.gateway.app import create_app
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.settings import GatewaySettings
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL

LIMIT = 1_000_000  # --max-body-bytes's default
TRIES = 20
BIG = json.dumps({"model": MODEL, "prompt": "x" * 3_000_000}).encode()  # 3 MB
KEY = "kvf-test-key"
ROOT = Path(__file__).resolve().parents[2]


async def serve(http: str, tokenizer, model_info, **settings):
    """The gateway on the fake engine, served by uvicorn on a loopback port: yields the port."""
    settings = GatewaySettings(**{"redis_url": "redis://127.0.0.1:1/0", "model": MODEL,
                                  "max_body_bytes": LIMIT, **settings})
    app = create_app(settings, FakeEngineClient(), tokenizer, model_info=model_info)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=http))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield port
    server.should_exit = True
    await asyncio.wait_for(task, 10)


@pytest.fixture(params=["httptools", "h11"])  # uvicorn's default (uvicorn[standard]), its other
async def served(request, tokenizer, model_info):
    async for port in serve(request.param, tokenizer, model_info):
        yield port


@pytest.fixture(params=["httptools", "h11"])
async def served_with_keys(request, tokenizer, model_info):
    async for port in serve(request.param, tokenizer, model_info, api_keys=KEY):
        yield port


@pytest.fixture(params=["httptools", "h11"])
async def served_with_room(request, tokenizer, model_info):
    """A limit the 3 MB body is within: it reaches the app unread."""
    async for port in serve(request.param, tokenizer, model_info, max_body_bytes=4 * LIMIT):
        yield port


def assert_error(status: int, body: bytes, expected: int, error_type: str,
                 code: str | None) -> dict:
    """An answer in OpenAI's error shape: its error object."""
    assert status == expected, body[:200]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (error_type, code)
    return error


def assert_413(status: int, body: bytes) -> None:
    error = assert_error(status, body, 413, "invalid_request_error", "request_too_large")
    assert str(LIMIT) in error["message"]


def post(port: int, body, headers: dict[str, str],
         path: str = "/v1/completions") -> tuple[int, bytes]:
    """One request on a fresh connection, as http.client sends it: the headers, then the whole
    body with sendall (a bytes body with Content-Length; an iterable one chunked), then reads."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", path, body=body,
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
    monkeypatch.setattr(early_answer, "DRAIN_MAX_S", 0.3)
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    huge = request + b"Content-Length: %d\r\n\r\n" % (early_answer.DRAIN_MAX_BYTES + 1)
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


# ---- the other answers sent before the body was read --------------------------------------------

def assert_401(status: int, body: bytes) -> None:
    assert_error(status, body, 401, "authentication_error", "invalid_api_key")


@pytest.mark.parametrize("connection", ["close", "keep-alive"])
async def test_a_3mb_body_without_a_key_gets_the_401_every_time(served_with_keys, connection):
    """ApiKeyAuth answers before the size limit reads anything: it was a reset in 18 of 20."""
    def tries() -> list[tuple[int, bytes]]:
        return [post(served_with_keys, BIG, {"Connection": connection}) for _ in range(TRIES)]
    for status, body in await asyncio.to_thread(tries):
        assert_401(status, body)


async def test_a_chunked_upload_without_a_key_gets_the_401_every_time(served_with_keys):
    def tries() -> list[tuple[int, bytes]]:
        return [post(served_with_keys, chunks(BIG), {"Connection": "close"})
                for _ in range(TRIES)]
    for status, body in await asyncio.to_thread(tries):
        assert_401(status, body)


async def test_a_drained_401_keeps_the_connection_and_a_key_passes_to_the_413(served_with_keys):
    def requests() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        connection = http.client.HTTPConnection("127.0.0.1", served_with_keys, timeout=10)
        answers = []
        try:
            for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
                connection.request("POST", "/v1/completions", body=BIG,
                                   headers={"Content-Type": "application/json", **headers})
                response = connection.getresponse()
                answers.append((response.status, response.read()))
            return tuple(answers)
        finally:
            connection.close()
    unauthorized, too_large = await asyncio.to_thread(requests)
    assert_401(*unauthorized)
    assert_413(*too_large)


async def test_a_401_waiting_for_100_continue_comes_at_once_and_closes(served_with_keys):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(BIG))
    answer_head, payload, seconds = await asyncio.to_thread(raw, served_with_keys, head)
    assert answer_head.startswith(b"http/1.1 401"), answer_head
    assert b"connection: close" in answer_head
    assert_401(401, payload)
    assert seconds < 5


@pytest.mark.parametrize(("path", "status"), [("/v1/no-such-route", 404), ("/v1/models", 405)])
async def test_the_apps_own_early_answers_are_drained(served_with_room, path, status):
    """A body within the limit passes the size check unread; the router answers 404 / 405
    without reading it, and still the client reads the answer, every time."""
    def tries() -> list[tuple[int, bytes]]:
        return [post(served_with_room, BIG, {"Connection": "close"}, path)
                for _ in range(TRIES)]
    for answer_status, body in await asyncio.to_thread(tries):
        assert answer_status == status, body[:200]


def test_the_docs_name_the_drain_bounds():
    """docs/API.md and the max_body_bytes setting (README.md's table is made from it) state the
    bounds of early_answer.py."""
    mib, seconds = early_answer.DRAIN_MAX_BYTES / 2**20, early_answer.DRAIN_MAX_S
    assert mib == int(mib)
    api = (ROOT / "docs" / "API.md").read_text()
    section = api.split("\n## Request size\n", 1)[1].split("\n## ", 1)[0]
    text = re.sub(r"\s+", " ", section)
    assert "(gateway/admission/early_answer.py)" in text
    assert f": {int(mib)} MiB of the request and {seconds:g} s." in text
    assert f"`Content-Length` over {int(mib)} MiB" in text
    assert re.findall(r"(\d+) MiB", text) == [str(int(mib))] * 2
    described = GatewaySettings.model_fields["max_body_bytes"].description
    assert f"up to {int(mib)} MiB and {seconds:g} s" in described


async def test_an_exception_before_any_answer_drains_the_body_too():
    """Starlette's outermost middleware answers an exception (500) with the unwrapped send: the
    body is drained before the exception goes up to it."""
    messages = [{"type": "http.request", "body": b"x" * 1000, "more_body": more}
                for more in (True, True, False)]
    scope = {"type": "http", "headers": [(b"content-length", b"3000")]}
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    async def failing(scope, receive, send):
        raise RuntimeError("before any answer")

    request = early_answer.UnreadBody(scope, receive, send)
    with pytest.raises(RuntimeError):
        await request.run(failing, scope)
    assert (messages, request.received, request.complete, sent) == ([], 3000, True, [])
