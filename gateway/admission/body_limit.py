"""Request body size limit: a body over `max_body_bytes` is a 413 before any handler parses it.

The 413 goes out once the upload has been read to its end (and discarded), up to
`DRAIN_MAX_BYTES` and `DRAIN_MAX_S`: most clients (Python's http.client and urllib, `requests`)
send the whole body before they read the answer, and a server that answers and closes while
unread bytes are still arriving makes its kernel reset the connection, so that the client sees
"connection reset by peer" or a broken pipe instead of the 413. An upload beyond either bound, a
declared Content-Length over `DRAIN_MAX_BYTES`, or a request that waits for `100 Continue` gets
the 413 at once with `Connection: close`."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError

DRAIN_MAX_BYTES = 64 * 1024 * 1024  # of one oversized request, counted from its first byte
DRAIN_MAX_S = 10.0


class BodySizeLimit:
    """ASGI middleware. Trusts Content-Length when given; otherwise reads the body (at most the
    limit plus one chunk) and replays it to the app."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, exempt_paths: tuple[str, ...] = ()):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.exempt_paths = exempt_paths  # routes that enforce a limit of their own (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_body_bytes:
                drain = (declared.isdigit() and int(declared) <= DRAIN_MAX_BYTES
                         and headers.get(b"expect", b"").lower() != b"100-continue")
                read_all = drain and await _drain(receive, 0)
                await self._too_large(scope, receive, send, read_all)
                return
            await self.app(scope, receive, send)
            return
        body, more, disconnected = bytearray(), True, False
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                received = len(body)
                body.clear()
                read_all = not more or await _drain(receive, received)
                await self._too_large(scope, receive, send, read_all)
                return
        await self.app(scope, _replay(bytes(body), receive, disconnected), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send,
                         read_all: bool) -> None:
        error = APIError(413, f"The request body is larger than the limit of "
                         f"{self.max_body_bytes} bytes.", code="request_too_large")
        response = error.response()
        if not read_all:  # the rest of the upload would be the next request's start
            response.headers["Connection"] = "close"
        await response(scope, receive, send)


async def _drain(receive: Receive, received: int) -> bool:
    """Reads and discards the rest of the request body, `received` bytes of it read already.
    True once it ended; False past DRAIN_MAX_BYTES or DRAIN_MAX_S, or when the client left."""
    try:
        async with asyncio.timeout(DRAIN_MAX_S):
            while received <= DRAIN_MAX_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return True
    except TimeoutError:
        pass
    return False


def _replay(body: bytes, receive: Receive, disconnected: bool) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent and not disconnected:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive() if not disconnected else {"type": "http.disconnect"}

    return replay
