"""Raw (``application/octet-stream``) bodies of tens of MB without copying them into fresh memory.

Litestar's ``Response`` renders one ``bytes`` body and its ``Stream`` takes only
``bytes``/``str`` chunks, so a slot state (a header plus the state buffer received from the
worker) would be joined or converted, copying every byte into fresh memory.
:class:`BuffersResponse` is a ``Response`` whose ``to_asgi_response`` (as Litestar's own
``Stream`` does) builds an ``ASGIResponse`` subclass overriding ``send_body``, the hook
Litestar's docs name for custom sending: it sends the buffers in order as ASGI body messages
under the ``Content-Length`` of their sum (no chunked encoding), and the server writes each
buffer to the socket as it is.

A request body the other way (a ``restore-state`` blob) is read chunk by chunk straight into
a buffer lent by :data:`BODY_POOL` (:func:`read_body`): Litestar's ``Request.body()`` joins
the chunks into new ``bytes`` whose pages are faulted in on first touch, which costs more
than the copy itself (see :mod:`contract.buffers`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from litestar import Request, Response
from litestar.response.base import ASGIResponse

from contract.buffers import BufferPool
from contract.framing import POOLED_BYTES, Buffer
from orchestrator.service_error import ServiceError

BODY_POOL = BufferPool(keep=1)
"""Where large request bodies are read (one kept buffer: the largest body given back)."""

if TYPE_CHECKING:
    from litestar.background_tasks import BackgroundTask, BackgroundTasks
    from litestar.datastructures import Cookie
    from litestar.types import Receive, Send


class _BuffersASGIResponse(ASGIResponse):
    def __init__(self, buffers: list[memoryview], sent: Callable[[], None] | None, **kwargs: Any) -> None:
        super().__init__(body=b"", content_length=sum(b.nbytes for b in buffers), **kwargs)
        self.buffers = buffers
        self.sent = sent

    async def send_body(self, send: Send, receive: Receive) -> None:
        """One ``http.response.body`` message per buffer (``more_body`` until the last), then ``sent()``."""
        buffers, self.buffers = self.buffers, []
        if not buffers:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        while buffers:
            body = buffers.pop(0)  # no reference left here once sent
            # a memoryview, not bytes as the type says: the server writes any buffer to its transport as is
            await send({"type": "http.response.body", "body": cast("bytes", body), "more_body": bool(buffers)})
            del body
        if self.sent is not None:
            self.sent()


class BuffersResponse(Response[None]):
    """A ``200`` answer whose body is ``buffers`` (objects with the buffer protocol, not copied)
    sent in order, with ``media_type`` and extra ``headers``; ``sent()`` is called once the server
    has taken the last of them (not when the client left before)."""

    def __init__(
        self,
        buffers: Sequence[Buffer],
        media_type: str,
        headers: Mapping[str, str],
        sent: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(content=None, media_type=media_type, headers=dict(headers))
        self.buffers = [memoryview(b).cast("B") for b in buffers]
        self.sent = sent

    def to_asgi_response(  # type: ignore[override]
        self,
        app: Any,
        request: Request,
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: str | None = None,
        status_code: int | None = None,
        type_encoders: Any = None,
    ) -> ASGIResponse:
        """The ``ASGIResponse`` sending the buffers (the handler's headers, cookies and background
        tasks merged as ``Response.to_asgi_response`` merges them)."""
        buffers, self.buffers = self.buffers, []
        return _BuffersASGIResponse(
            buffers,
            self.sent,
            background=self.background or background,
            cookies=self.cookies if cookies is None else itertools.chain(self.cookies, cookies),
            encoded_headers=encoded_headers,
            headers={**headers, **self.headers} if headers is not None else self.headers,
            is_head_response=is_head_response,
            media_type=self.media_type or media_type,
            status_code=self.status_code or status_code,
        )


async def read_body(request: Request[Any, Any, Any]) -> Buffer:
    """The request body: bytes of :data:`POOLED_BYTES` or more (by ``Content-Length``) are read
    into a view lent by :data:`BODY_POOL` (hand it back with ``BODY_POOL.give`` once nothing
    reads it any more, else ``BODY_POOL.drop``); smaller or unsized bodies are Litestar's ``Request.body()``.
    A client that stops before ``Content-Length`` bytes ends the request as Litestar does."""
    try:
        n = int(request.headers.get("content-length", ""))
    except ValueError:
        n = -1
    if n < POOLED_BYTES:
        return await request.body()
    view = BODY_POOL.take(n)
    got = 0
    try:
        async for chunk in request.stream():
            k = len(chunk)
            view[got : got + k] = chunk  # the server stops reading at Content-Length: never past the end
            got += k
    except BaseException:
        BODY_POOL.drop(view)
        raise
    return view if got == n else view[:got]


@contextlib.contextmanager
def lent_to_worker(buf: Buffer) -> Iterator[Buffer]:
    """Hold a :data:`BODY_POOL` buffer while it goes to the worker: back to the pool when the block ends
    normally or with an ``ApiError`` (refused before the worker got it, or answered by the worker: either
    way nothing reads it any more); dropped on anything else (cancelled while it may still be on its way)."""
    try:
        yield buf
    except ServiceError:
        BODY_POOL.give(buf)
        raise
    except BaseException:
        BODY_POOL.drop(buf)
        raise
    BODY_POOL.give(buf)
