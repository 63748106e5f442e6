"""Request body size limit: a body over `max_body_bytes` is a 413 before any handler parses it."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError


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
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
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
                await self._too_large(scope, receive, send)
                return
        await self.app(scope, _replay(bytes(body), receive, disconnected), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"The request body is larger than the limit of "
                         f"{self.max_body_bytes} bytes.", code="request_too_large")
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive: Receive, disconnected: bool) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent and not disconnected:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive() if not disconnected else {"type": "http.disconnect"}

    return replay
