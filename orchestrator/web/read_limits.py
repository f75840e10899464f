"""Limits on how a client sends a request: head size, head time, body pauses.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not a request in
progress: with its httptools parser a head may grow without limit and a client may send it, or
a body, a byte a minute, holding a connection and its buffers for ever (slowloris). nginx's
``client_header_timeout``, ``client_body_timeout`` and ``large_client_header_buffers`` close
that gap in front of a server (https://nginx.org/en/docs/http/ngx_http_core_module.html);
:func:`limited_protocol` gives uvicorn the same three, as a subclass of its own httptools
protocol (passed as uvicorn's ``http=`` protocol class), with the same meanings:

* the request line and headers must arrive within ``header_timeout_s`` of the connection (or
  of the request's first byte): else ``408`` ``REQUEST_TIMEOUT`` and the connection closes;
* they may take at most ``max_header_bytes``: else ``431`` ``PAYLOAD_TOO_LARGE``, closed;
* while a body is read, the client may pause at most ``body_timeout_s`` between two pieces
  (not counted while the server itself stops reading, uvicorn's flow control): else ``408``
  ``REQUEST_TIMEOUT`` if nothing was answered yet, and the connection closes.

docs/operations.md ("Configuration") documents the flags.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from contract.errors import ErrorCode


@dataclass(frozen=True)
class ReadLimits:
    """``max_header_bytes``: request line plus headers, bytes; ``header_timeout_s``,
    ``body_timeout_s``: seconds (see the module's docstring)."""

    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over the limit."""


def _reply(status: int, reason: bytes, code: ErrorCode, message: str) -> bytes:
    body = msgspec.json.encode({"error": message, "error_code": code})
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % (status, reason, len(body))
    ) + body


class _LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ReadLimits` (set by :func:`limited_protocol`)."""

    limits = ReadLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request line and headers
        self._head_bytes = 0  # bytes received for the current head (an upper bound: see data_received)
        self._head_size = 0  # bytes of its URL and headers, as parsed
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False

    # -- timers

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._closing or self.transport.is_closing():
            return
        if not self._in_head:
            if self.cycle is None or not self.cycle.more_body:
                return  # the body is in: the application's time is its own
            if self.flow.read_paused:  # the server stopped reading, not the client
                self._arm(self.limits.body_timeout_s)
                return
        answered = self.cycle is not None and self.cycle.response_started and not self._in_head
        what = "request headers" if self._in_head else "request body"
        self._refuse(None if answered else _reply(408, b"Request Timeout", ErrorCode.REQUEST_TIMEOUT,
                                                   f"the {what} did not arrive in time"))  # fmt: skip

    def _refuse(self, reply: bytes | None) -> None:
        self._closing = True
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the application sees the client gone
            self.cycle.message_event.set()
        if reply is not None:
            self.transport.write(reply)
        self.transport.close()

    # -- uvicorn's protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if self._in_head:
            self._head_bytes += len(data)
        elif self.cycle is not None and self.cycle.more_body:
            self._arm(self.limits.body_timeout_s)
        super().data_received(data)
        # Still in a head after all of ``data``: all of it was head (but for the end of a previous
        # request's body in the same piece, at most one read).
        if not self._closing and self._in_head and self._head_bytes > self.limits.max_header_bytes + (64 << 10):
            self._too_large()

    def send_400_response(self, msg: str) -> None:
        if not self._closing:  # a head over the limit stops the parser (_HeadTooLarge) with a reply of its own
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._head_size = True, 0, 0
        if self._timer is None:
            self._arm(self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            self._arm(self.limits.body_timeout_s)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _count(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self.limits.max_header_bytes:
            self._too_large()
            raise _HeadTooLarge

    def _too_large(self) -> None:
        if not self._closing:
            self._refuse(_reply(431, b"Request Header Fields Too Large", ErrorCode.PAYLOAD_TOO_LARGE,
                                f"request headers over {self.limits.max_header_bytes} bytes"))  # fmt: skip


def limited_protocol(limits: ReadLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools HTTP protocol class with ``limits`` (for ``uvicorn.run(http=...)``)."""
    return type("LimitedHttpToolsProtocol", (_LimitedHttpToolsProtocol,), {"limits": limits})
