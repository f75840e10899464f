"""WebSocket generation: the binary stream and the JSON event stream (docs/api.md).

``/api/extra/generate/stream/ws``: the first client frame is the
generation config; per token a JSON text frame then (with attention) one binary
frame of raw ``float32`` (or ``float16``) ``[n_layers, n_heads, context_length]``;
then ``{"type":"done"}`` and a clean close (code 1000).

``/api/v1/generate/stream``: ``{"type":"generate", ...}`` messages, each
answered by ``token`` events (base64 attention, ``logprob``, ``top_logprobs``) and a
``done`` event with ``generation_time_ms``; failures are ``error`` events.  The socket
stays open for the next request.

On both, ``{"type":"cancel"}`` stops the running generation within one decode step
(its ``done`` says ``cancelled``) and a client that goes away cancels it too.
Messages over the size limit get a ``PAYLOAD_TOO_LARGE`` error and the socket closes.

Memory per socket is bounded both ways: the generation runs only a few tokens ahead of the
frames this socket has sent (flow control, :mod:`contract.flow`: ``--stream-window`` tokens and
``--stream-window-bytes``; each send waits while uvicorn's transport buffer is full), and the
client's messages wait in a bounded :class:`Inbox` (past it the server stops reading the socket;
uvicorn's ``websockets-sansio`` protocol, pinned in orchestrator/cli.py, then holds at most the
message it was reading).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec
import structlog
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect

from contract.errors import ErrorCode
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.native.protocol import (
    QueuedEvent,
    binary_token_frame,
    done_event,
    payload_bytes,
    progress_event,
    token_event,
)
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.service import RunControl
from orchestrator.service_error import ServiceError
from orchestrator.services import Services
from orchestrator.tenants.conversation import identify
from orchestrator.web.body import decode_json_body
from orchestrator.web.encode import encoded_text
from orchestrator.web.errors import ApiError, ErrorEvent, report, route_of

log = structlog.get_logger("slotserve.ws")
_json = msgspec.json.Encoder()


class _Closed(Exception):
    """The client disconnected."""


_CLOSED = object()

INBOX_MESSAGES = 16
"""Client messages one socket may have waiting (read, not yet served) before the server stops reading it."""


class Inbox:
    """All client messages of one socket, read by one task into a bounded queue.

    A message that arrives while a generation runs is looked at (``cancel``) and, if it
    is anything else, kept for the next request: nothing a client sends is lost.

    Bounded: once :data:`INBOX_MESSAGES` messages, or ``limit`` bytes (``len`` of the text or
    bytes; one message is at most ``limit``), wait to be served, the reader stops reading the
    socket until the handler takes one.  The server then reads nothing more (uvicorn pauses the
    transport, and TCP pushes back on the client), so a socket holds at most 16 messages and
    under ``2 * limit`` bytes of them, however many it sends during one generation.  A message
    over ``limit`` is not kept: it becomes a ``PAYLOAD_TOO_LARGE`` error in its place.
    """

    def __init__(self, socket: WebSocket[Any, Any, Any], limit: int) -> None:
        self.socket = socket
        self.limit = limit
        self.items: deque[tuple[object, int]] = deque()  # (message, error or _CLOSED; its size)
        self.size = 0  # bytes (or characters) of the messages waiting
        self._arrived = asyncio.Event()  # set while ``items`` is not empty
        self._room = asyncio.Event()  # set while another message may be read
        self._room.set()
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            while True:
                await self._room.wait()
                msg = await self.socket.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                text, raw = msg.get("text"), msg.get("bytes")
                data: str | bytes = text if isinstance(text, str) else raw if isinstance(raw, bytes) else b""
                if len(data) > self.limit:
                    big = f"message of {len(data)} bytes exceeds the {self.limit} byte limit"
                    self._push(ApiError(ErrorCode.PAYLOAD_TOO_LARGE, big), 0)
                    continue
                self._push(data, len(data))
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        self._push(_CLOSED, 0)

    def _push(self, item: object, size: int, front: bool = False) -> None:
        if front:
            self.items.appendleft((item, size))
        else:
            self.items.append((item, size))
        self.size += size
        self._arrived.set()
        self._update_room()

    def _update_room(self) -> None:
        if len(self.items) < INBOX_MESSAGES and self.size < self.limit:
            self._room.set()
        else:
            self._room.clear()

    async def get(self) -> str | bytes:
        """Next message; raises :class:`_Closed` on disconnect, ``PAYLOAD_TOO_LARGE`` for a big one.

        Cancelling a pending ``get`` leaves the inbox as it was."""
        while not self.items:
            self._arrived.clear()
            await self._arrived.wait()
        item, size = self.items[0]
        if item is _CLOSED:
            raise _Closed  # it stays in: closed for every later get
        self.items.popleft()
        self.size -= size
        self._update_room()
        if isinstance(item, ApiError):
            raise item
        return item  # type: ignore[return-value]

    def put_back(self, data: str | bytes) -> None:
        """Return a message to the front of the queue (it may go over the bound by this one)."""
        self._push(data, len(data), front=True)

    async def close(self) -> None:
        """Stop reading."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


def _is_cancel(data: str | bytes) -> bool:
    try:
        msg = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    return isinstance(msg, dict) and msg.get("type") == "cancel"


def _parse(data: str | bytes) -> GenerateRequest:
    return decode_json_body(data, GenerateRequest)


async def _send_json(socket: WebSocket[Any, Any, Any], event: msgspec.Struct) -> None:
    """``event`` as one JSON text frame (encoded by msgspec)."""
    await socket.send_text(_json.encode(event).decode())


async def _error(socket: WebSocket[Any, Any, Any], exc: BaseException, request_id: str | None) -> None:
    await _send_json(socket, ErrorEvent.of(report(exc, route_of(socket)), request_id))


async def run_controlled(
    inbox: Inbox,
    services: Services,
    req: CanonicalRequest,
    on_token: Callable[[TokenOut], Awaitable[None]],
    on_done: Callable[[DoneOut], Awaitable[None]],
) -> None:
    """Run one generation while watching the client for ``cancel`` or a disconnect.

    Progress events (``return_progress``) go to the client as JSON text frames, the same
    on both WebSockets.

    While the request waits for a free engine sequence, the client gets
    ``{"type": "queued", "position": N, "request_id"}`` frames (1 = next).

    Raises :class:`_Closed` if the client went away (the generation is cancelled), and
    ``PAYLOAD_TOO_LARGE`` if it sent an oversized message meanwhile (after stopping).
    """

    async def on_queued(position: int) -> None:
        await _send_json(inbox.socket, QueuedEvent(position=position, request_id=req.request_id))

    control = RunControl(on_queued)

    async def pump() -> None:
        run = services.generation.run(req, control)
        try:
            async for ev in run:
                if isinstance(ev, TokenOut):
                    await on_token(ev)
                elif isinstance(ev, DoneOut):
                    await on_done(ev)
                elif isinstance(ev, ProgressOut):
                    await _send_json(inbox.socket, progress_event(ev, req.request_id))
        finally:
            await run.aclose()

    sender = asyncio.create_task(pump())
    try:
        while True:
            getter = asyncio.create_task(inbox.get())
            await asyncio.wait({sender, getter}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()  # a pending Queue.get leaves the queue as it was
                with contextlib.suppress(asyncio.CancelledError):
                    await getter
                break
            try:
                data = getter.result()
            except _Closed:
                sender.cancel()  # the client is gone
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
                raise
            except ServiceError:
                await control.cancel()
                await sender
                raise
            if _is_cancel(data):
                await control.cancel()
                continue
            inbox.put_back(data)  # the next request: served after this one
            break
        await sender
    finally:
        if not sender.done():
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender


@websocket("/api/extra/generate/stream/ws")
async def binary_stream(socket: WebSocket[Any, Any, Any], services: Services) -> None:
    """The binary WebSocket (docs/api.md, "WS /api/extra/generate/stream/ws"): JSON config in;
    per token a JSON text frame then a binary attention frame (format ``topk``: then its positions' frame)."""
    await socket.accept()
    inbox = Inbox(socket, services.settings.max_body_bytes)
    request_id = None
    try:
        body = _parse(await inbox.get())
        if body.return_attention is None and body.output_attentions is None:
            body.output_attentions = True  # this endpoint exists to stream attention
        req = identify(body.canonical(), socket)
        request_id = req.request_id

        async def on_token(t: TokenOut) -> None:
            await _send_json(socket, binary_token_frame(t, req.attention_format))
            for buf in (t.attention, t.positions):  # as received from the worker (Litestar's send_bytes wants bytes)
                if buf is not None:  # topk: the int32 positions follow the weights in a second binary frame
                    await socket.send({"type": "websocket.send", "bytes": buf, "text": None})  # type: ignore[typeddict-item]

        async def on_done(d: DoneOut) -> None:
            await _send_json(socket, done_event(d, request_id))

        await run_controlled(inbox, services, req, on_token, on_done)
    except (_Closed, WebSocketDisconnect):
        await inbox.close()
        return
    except Exception as exc:
        with contextlib.suppress(Exception):
            await _error(socket, exc, request_id)
    await inbox.close()
    with contextlib.suppress(Exception):
        await socket.close(code=1000)


@websocket("/api/v1/generate/stream")
async def event_stream(socket: WebSocket[Any, Any, Any], services: Services) -> None:
    """The JSON WebSocket (docs/api.md, "WS /api/v1/generate/stream"): ``generate`` messages
    answered by ``token``/``done``/``error`` events."""
    await socket.accept()
    inbox = Inbox(socket, services.settings.max_body_bytes)
    try:
        await _serve_events(socket, inbox, services)
    finally:
        await inbox.close()


async def _serve_events(socket: WebSocket[Any, Any, Any], inbox: Inbox, services: Services) -> None:
    while True:
        request_id = None
        try:
            body = _parse(await inbox.get())
            request_id = body.request_id
            if body.type not in (None, "generate"):
                if body.type == "cancel":
                    continue  # nothing is running
                raise ApiError(ErrorCode.INVALID_REQUEST, f"unknown message type {body.type!r}")
            req = identify(body.canonical(), socket)
            pieces = await services.generation.pieces()

            async def on_token(t: TokenOut, req: CanonicalRequest = req, pieces: list[bytes] = pieces) -> None:
                build = partial(token_event, t, req.request_id, req.attention_format, req.attention_dtype, pieces)
                await socket.send_text(await encoded_text(build, payload_bytes(t)))

            async def on_done(d: DoneOut, req: CanonicalRequest = req) -> None:
                await _send_json(socket, done_event(d, req.request_id))

            await run_controlled(inbox, services, req, on_token, on_done)
        except (_Closed, WebSocketDisconnect):
            return
        except ServiceError as exc:
            with contextlib.suppress(Exception):
                await _error(socket, exc, request_id)
            if exc.code is ErrorCode.PAYLOAD_TOO_LARGE:
                with contextlib.suppress(Exception):
                    await socket.close(code=1009)
                return
        except Exception as exc:
            with contextlib.suppress(Exception):
                await _error(socket, exc, request_id)
