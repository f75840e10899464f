"""Server-sent events, framed once for every surface (WHATWG HTML, "Server-sent events").

Two framings: OpenAI's and llama-server's ``data: {json}`` (:func:`sse_data`) and KoboldCpp's
``event: message`` + ``data: {json}`` (:class:`JsonEvent`); both carry one JSON object per event.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar.openapi import ResponseSpec
from litestar.response import Stream
from litestar.response.sse import ServerSentEventMessage
from msgspec import UNSET, UnsetType

from orchestrator.web.errors import (
    COMPAT_ERROR_RESPONSES,
    ERROR_RESPONSES,
)

_json = msgspec.json.Encoder()


class SseEvent(msgspec.Struct, kw_only=True):
    """One server-sent event as a client's parser reads it (WHATWG HTML, "Server-sent events"):
    ``data`` is one JSON object (docs/api.md), ``event`` its type (``message``)."""

    data: str
    event: str | UnsetType = UNSET
    id: str | UnsetType = UNSET
    retry: int | UnsetType = UNSET


def event_stream(description: str) -> dict[int, ResponseSpec]:
    """``responses=`` of a route that answers server-sent events (``text/event-stream``; the schema is
    that of each event, :class:`SseEvent`) or an error body before the stream starts."""
    spec = ResponseSpec(SseEvent, description=description, media_type="text/event-stream", generate_examples=False)
    return {**ERROR_RESPONSES, 200: spec}


def streamable(body: Any, errors: dict[int, ResponseSpec] = COMPAT_ERROR_RESPONSES) -> dict[int, ResponseSpec]:
    """``responses=`` of a route that answers ``body`` (a Struct, or a union of the answers it may give) as
    JSON, or server-sent events with ``stream: true``, with the error statuses ``errors`` (default: in
    llama-server's/OpenAI's shape)."""
    spec = ResponseSpec(
        body,
        description="the completion; with ``stream: true`` server-sent events (text/event-stream) instead",
        generate_examples=False,
    )
    return {**errors, 200: spec}


def sse_data(obj: Any) -> bytes:
    """``data: {json}\\n\\n``: one event as OpenAI and llama-server frame it."""
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(Stream):
    """A ``text/event-stream`` response from a handler that may also answer JSON.

    Litestar gives the route's media type (JSON, for a handler returning ``dict | Stream``)
    precedence over the response's own; this keeps the stream's.
    """

    def __init__(self, content: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = self.media_type
        return super().to_asgi_response(*args, **kwargs)


class JsonEvent(ServerSentEventMessage):
    """A seed-001 event, framed like KoboldCpp: ``event: message\\ndata: {json}\\n\\n``.

    ``data`` is one line of JSON bytes (msgspec escapes every line break inside strings),
    so the frame is joined directly.  Litestar's own ``encode`` splits ``data`` on line
    breaks with a regex and copies it through a StringIO and a UTF-8 encode, which took
    over half of the orchestrator's time for 760 KB attention events (py-spy, 500-token
    context); the frame it would build is the same.
    """

    def encode(self) -> bytes:
        assert isinstance(self.data, bytes)
        return b"".join((b"event: message\ndata: ", self.data, b"\n\n"))


def named_event(event: msgspec.Struct) -> bytes:
    """``event: <type>\ndata: {json}\n\n``: ``event`` (a Struct tagged by its ``type``) as OpenAI's
    Responses API frames its events, the event name being the tag."""
    tag = event.__struct_config__.tag
    return b"event: " + str(tag).encode() + b"\ndata: " + _json.encode(event) + b"\n\n"


def json_event(event: msgspec.Struct) -> JsonEvent:
    """``event`` encoded by msgspec as one KoboldCpp-framed event."""
    return JsonEvent(data=_json.encode(event))


class QueuedComment(ServerSentEventMessage):
    """``: queued position N``: an SSE comment line (ignored by EventSource clients) sent while
    the request waits for a free engine sequence (1 = next; :mod:`orchestrator.slots.admission`)."""

    def encode(self) -> bytes:
        return f": {self.comment}\n\n".encode()
