"""Connections that never finish their request headers are closed.

uvicorn's h11 protocol arms no timer before a connection's first request, and its keep-alive
timer is cancelled by any byte that arrives: a client that opens connections and sends its
headers one byte at a time (or never) holds each connection, and its buffer, for as long as it
likes (slowloris). `header_timeout_protocol(s)` is uvicorn's H11Protocol with one more rule:

    a connection waiting for a request's headers (new, or idle between two requests) must
    receive all of them within `s` seconds, whatever trickles in meanwhile; then it is closed.

The body has its own limits (body.py); a header block larger than h11's incomplete-event limit
(16 KiB by default) is already a 400.

    uvicorn.Config(app, http=header_timeout_protocol(config.header_timeout_s), ...)
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """H11Protocol closing a connection whose request headers take over `timeout_s`."""

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a request's headers are all in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:  # waiting for the next request's headers
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if getattr(self, "_header_timer", None) is None:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
