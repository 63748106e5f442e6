"""Request body size limit: a body over `max_body_bytes` is a 413 before any handler parses it.

The 413, like every answer sent before the body was read to its end, goes out once the rest of
the upload has been read and discarded, within the bounds of gateway/admission/early_answer.py
(else at once, with `Connection: close`). Every request runs through `UnreadBody` here, so an
answer the app starts before it read the body (404, 405, an admin route's 401) is drained too."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfleet.gateway.admission.early_answer import UnreadBody
from kvfleet.gateway.http.errors import APIError


class BodySizeLimit:
    """ASGI middleware. Trusts Content-Length when given; otherwise reads the body (at most the
    limit plus one chunk) and replays it to the app."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, exempt_paths: tuple[str, ...] = ()):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.exempt_paths = exempt_paths  # routes that enforce a limit of their own (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = UnreadBody(scope, receive, send)
        if scope.get("path") in self.exempt_paths:
            await request.run(self.app, scope)
            return
        declared = request.declared
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_body_bytes:
                await request.answer(self._too_large(), scope)
                return
            await request.run(self.app, scope)
            return
        body, more = bytearray(), True
        while more:
            message = await request.receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                body.clear()
                await request.answer(self._too_large(), scope)
                return
        await request.run(self.app, scope, _replay(bytes(body), request.receive, request.left))

    def _too_large(self) -> Response:
        return APIError(413, f"The request body is larger than the limit of "
                        f"{self.max_body_bytes} bytes.", code="request_too_large").response()


def _replay(body: bytes, receive: Receive, disconnected: bool) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent and not disconnected:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive() if not disconnected else {"type": "http.disconnect"}

    return replay
