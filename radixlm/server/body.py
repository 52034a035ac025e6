"""Reading a request body with bounds: its size, its total time and the gaps between its pieces.

`BodyLimitMiddleware` reads every body before the app sees it and hands the app the whole body
in one message, so no route ever reads an unbounded body itself:

    over max_body_bytes (Content-Length, or counted as it streams in)  -> 413 at once
    not all there within body_timeout_s, or a gap over idle_timeout_s  -> 408
    the client hangs up mid-body                                       -> no answer, a debug log

A refused body is not read further: the response goes out with `Connection: close` and the
server drops the connection, so a 300 MiB upload costs what arrived before the limit, and a
client trickling one byte every two seconds holds its connection for a bounded time.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.server.errors import APIError

log = logging.getLogger(__name__)


class BodyLimitMiddleware:
    """A pure ASGI middleware: buffers the body within the limits, then runs the app."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout_s: float, idle_timeout_s: float
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(scope, receive, send, 413, self._too_large())
            return
        body = await self._read(scope, receive, send)
        if body is None:
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:  # the body, once; then the live channel (disconnect watchers)
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once the request was answered (413 / 408) or abandoned."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body = bytearray()
        while True:
            wait = min(self.idle_timeout_s, deadline - loop.time())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0.0))
            except TimeoutError:
                message = None
            if message is None:
                late = deadline - loop.time() <= 0
                limit = self.timeout_s if late else self.idle_timeout_s
                what = "whole body" if late else "next piece of the body"
                message_text = f"The request's {what} did not arrive within {limit:g} s"
                await _refuse(scope, receive, send, 408, message_text)
                return None
            if message["type"] == "http.disconnect":
                log.debug("client went away mid-body: %s %s", scope["method"], scope["path"])
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await _refuse(scope, receive, send, 413, self._too_large())
                return None
            if not message.get("more_body", False):
                return bytes(body)

    def _too_large(self) -> str:
        return f"The request body is larger than {self.max_bytes} bytes"


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    response = APIError(status, message, headers={"Connection": "close"}).response()
    await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length before we run
    return None
