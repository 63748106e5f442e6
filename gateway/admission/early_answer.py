"""Answers sent before the request body was read to its end: the gateway's 413 (body too large),
401 and 503 (API key), and any answer the app starts first (404, 405, an admin route's 401 or 403,
a 500). Most clients (Python's http.client and urllib, `requests`) send the whole body before they
read the answer, and a server that answers and closes while unread bytes are still arriving makes
its kernel reset the connection, so that the client sees "connection reset by peer" or a broken
pipe instead of the answer. So such an answer waits until the rest of the body has been read and
discarded, up to `DRAIN_MAX_BYTES` of the request (counted from its first byte) and `DRAIN_MAX_S`;
a drained answer leaves the connection open for the next request. A declared Content-Length over
`DRAIN_MAX_BYTES`, a request that waits for `100 Continue` (its body is then never sent) or an
upload past either bound gets its answer at once with `Connection: close`.

One mechanism for every early answer: `UnreadBody` wraps a request's receive and send; an answer
a middleware sends itself goes out through `answer`, and the app behind it runs through `run`."""

from __future__ import annotations

import asyncio

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DRAIN_MAX_BYTES = 64 * 1024 * 1024  # of one request answered early, counted from its first byte
DRAIN_MAX_S = 10.0


class UnreadBody:
    """One HTTP request's receive and send, wrapped: `receive` counts the body as it is read;
    `send` reads and discards what is left of it (within the bounds) before an answer starts,
    and adds `Connection: close` when it could not read it to its end."""

    def __init__(self, scope: Scope, receive: Receive, send: Send):
        self._receive = receive
        self._send = send
        headers = dict(scope.get("headers") or [])
        self.declared = headers.get(b"content-length")
        self._expects_continue = headers.get(b"expect", b"").lower() == b"100-continue"
        self.received = 0  # bytes of the body read so far
        self.complete = (self.declared in (None, b"0")  # HTTP/1.1: no length, no chunks: no body
                         and b"transfer-encoding" not in headers)
        self.left = False  # the client disconnected
        self.asked = False  # receive was called (the server then sent any `100 Continue`)
        self.started = False  # the answer started

    async def receive(self) -> Message:
        self.asked = True
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.left = True
        elif message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self.started:
            self.started = True
            if not await self.drain():  # the rest of the upload would be the next request's start
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await self._send(message)

    async def drain(self) -> bool:
        """Reads and discards the rest of the body. True once it ended (at once when it had);
        False past DRAIN_MAX_BYTES or DRAIN_MAX_S, when it is not to be waited for, or when the
        client left."""
        if self.complete or self.left:
            return self.complete
        declared = self.declared
        if declared is not None and (not declared.isdigit() or int(declared) > DRAIN_MAX_BYTES):
            return False
        if self._expects_continue and not self.asked:  # the client sends nothing before 100
            return False
        try:
            async with asyncio.timeout(DRAIN_MAX_S):
                while not self.complete and not self.left and self.received <= DRAIN_MAX_BYTES:
                    await self.receive()
        except TimeoutError:
            pass
        return self.complete

    async def answer(self, response: Response, scope: Scope) -> None:
        """Sends a middleware's own answer, once the body has been drained."""
        await response(scope, self.receive, self.send)

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive | None = None) -> None:
        """Runs `app` on the wrapped receive (or `receive`, reading from this one) and send. An
        exception before any answer drains the body too: Starlette's outermost middleware
        answers it (500) with the unwrapped send, and the server closes the connection."""
        try:
            await app(scope, receive or self.receive, self.send)
        except Exception:
            if not self.started:
                await self.drain()
            raise
