"""The receive side of :class:`orchestrator.engine_client.client.WorkerClient`: the worker's replies routed to
the requests waiting for them, and what a waiting request makes of them.

Every request the client sends carries an id (``req``, :class:`contract.protocol.Message`); every reply the
worker sends back names the request it answers.  The client's reader task hands each reply, with the receive
buffers of its frame (:mod:`contract.framing`), to :meth:`PendingReplies.deliver`, which queues it for that
request; when the connection ends, :meth:`PendingReplies.fail_all` queues ``None`` for every request still
waiting.  A request with one answer reads one item (:func:`single_reply`); a generation reads its queue as
a stream of events (:func:`generation_events`) until its ``Done``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.framing import RecvBuffer
from orchestrator.engine_client.interface import EngineDeadError, EngineEvent, EngineRequestError, TokenOutput

R = TypeVar("R", bound=proto.Message)

Event = tuple[proto.Reply, list[RecvBuffer]]
"""A reply and the receive buffers of its frame (its tensors' bytes)."""

DRAIN_WAIT_S = 30.0
"""How long (s) a cancelled generation's stream waits for each next reply before it is given up."""


class PendingReplies:
    """The requests waiting for the worker's replies: one queue per request id, ``None`` queued when the
    worker's connection is gone.  Only the client's event loop touches it (no locking)."""

    def __init__(self) -> None:
        self._queues: dict[int, asyncio.Queue[Event | None]] = {}

    def open(self, req: int) -> asyncio.Queue[Event | None]:
        """Start waiting for the replies to request ``req``; returns the queue they arrive in."""
        q: asyncio.Queue[Event | None] = asyncio.Queue()
        self._queues[req] = q
        return q

    def __len__(self) -> int:
        """How many requests are waiting."""
        return len(self._queues)

    def queue_of(self, req: int) -> asyncio.Queue[Event | None] | None:
        """The queue of request ``req``'s replies; ``None`` when nothing waits for ``req``."""
        return self._queues.get(req)

    def close(self, req: int) -> None:
        """Stop waiting for request ``req`` (its later replies are dropped); a no-op when not waiting."""
        self._queues.pop(req, None)

    def deliver(self, reply: proto.Reply, bufs: list[RecvBuffer]) -> None:
        """Queue ``reply`` (with its frame's buffers) for the request it answers, ``reply.req``; a reply no
        request waits for any more (a cancelled or finished one) is dropped."""
        q = self.queue_of(reply.req)
        if q is not None:
            q.put_nowait((reply, bufs))

    def fail_all(self) -> None:
        """The worker's connection is gone: queue ``None`` for every request still waiting."""
        for q in self._queues.values():
            q.put_nowait(None)


def single_reply(item: Event | None, request: proto.Message, answer: type[R]) -> tuple[R, list[RecvBuffer]]:
    """The one reply to ``request``, which must be an ``answer``, with its frame's buffers.

    Raises :class:`EngineDeadError` when the worker died first (``item`` is ``None``),
    :class:`EngineRequestError` with the worker's code for an ``Error`` reply, and with ``INTERNAL`` for a
    reply of another type."""
    if item is None:
        raise EngineDeadError("the engine worker died during the request")
    reply, bufs = item
    if isinstance(reply, proto.Error):
        raise EngineRequestError(reply.code, reply.message)
    if not isinstance(reply, answer):
        raise EngineRequestError(ErrorCode.INTERNAL, f"the worker answered {type(request).__name__} with {reply!r}")
    return reply, bufs


async def generation_events(
    q: asyncio.Queue[Event | None], abandon: Callable[[], Awaitable[None]], close: Callable[[], None]
) -> AsyncGenerator[EngineEvent, None]:
    """A generation's events from its reply queue ``q``: :class:`TokenOutput` per ``Token``, each ``Progress``,
    and its ``Done`` last.

    Raises :class:`EngineDeadError` when the worker dies, :class:`EngineRequestError` (code, message,
    ``refused``) for an ``Error`` reply.  Left before its end (closed or cancelled by the consumer), it awaits
    ``abandon()`` (cancel the generation in the worker); in every case it calls ``close()`` (stop waiting)."""
    finished = False
    try:
        while True:
            item = await q.get()
            if item is None:
                finished = True
                raise EngineDeadError("the engine worker died during generation")
            reply, bufs = item
            if isinstance(reply, proto.Error):
                finished = True
                raise EngineRequestError(reply.code, reply.message, reply.refused)
            if isinstance(reply, proto.Token):
                yield token_output(reply, bufs)
            elif isinstance(reply, proto.Progress):
                yield reply
            elif isinstance(reply, proto.Done):
                finished = True
                yield reply
                return
    finally:
        if not finished:
            await abandon()
        close()


async def drain_to_end(q: asyncio.Queue[Event | None]) -> None:
    """Read a cancelled generation's reply queue ``q`` up to its end: its ``Done`` or ``Error``, or the worker's
    death.  Raises :class:`TimeoutError` when no reply comes for :data:`DRAIN_WAIT_S` seconds."""
    while True:
        item = await asyncio.wait_for(q.get(), DRAIN_WAIT_S)
        if item is None or isinstance(item[0], proto.Done | proto.Error):
            return


def token_output(msg: proto.Token, bufs: list[RecvBuffer]) -> TokenOutput:
    """A ``Token`` event with the tensors it describes taken from its frame's buffers: its attention rows
    (``[n_layers_sel, n_heads, n_ctx]`` or ``[n_ctx]``, float32 or float16), hidden state (``float32[n_embd]``)
    and attention positions (``int32``), as :class:`contract.protocol.Token` describes them."""
    attention = msg.attention.take(bufs) if msg.attention is not None else None
    hidden = msg.hidden.take(bufs) if msg.hidden is not None else None
    positions = msg.attention_pos.take(bufs) if msg.attention_pos is not None else None
    return TokenOutput(msg, attention, hidden, positions)  # type: ignore[arg-type]
