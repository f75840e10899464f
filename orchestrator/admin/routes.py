"""The admin page and its API: ``GET /admin`` (static HTML + script shipped in the package).

Everything here needs the admin key when the server has one (``--admin-key``;
``X-Admin-Key`` header, ``Bearer`` or ``?admin_key=`` for the page and its
EventSource).  The page's actions are the slot API's own
(``POST /slots/{id}?action=save|erase|context-shift|fork``), which ask for the same key.

``GET /admin/events`` is a server-sent event stream:

* ``{"type": "slots", "node", "slots": [SlotView...]}`` when the listing changed
  (looked at once a second, sent only on change);
* ``{"type": "error", "error", "error_code"}`` when the listing cannot be read (engine
  restarting, store down); the stream goes on;
* ``{"type": "attention", "slot_id", "index", "text", "layer", "n_ctx", "data"}`` for
  each token a generation streams to its client with attention: ``data`` is base64
  little-endian ``float32[n_ctx]``, the mean over every layer and head, or over the
  heads of ``?layer=N`` (per-layer streams only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import msgspec
from litestar import Controller, MediaType, Request, Response, get
from litestar.params import Parameter
from litestar.response import ServerSentEvent

from contract.errors import ErrorCode
from orchestrator.admin.protocol import AttentionEvent, SlotsEvent
from orchestrator.admin.view import AdminView, SlotView
from orchestrator.api.common.wire import SlotMessages
from orchestrator.services import Services
from orchestrator.web.auth import require_admin
from orchestrator.web.errors import ERROR_RESPONSES, ApiError, ErrorEvent, report, route_of
from orchestrator.web.sse import JsonEvent, event_stream, json_event

LISTING_EVERY_S = 1.0  # the slot listing is looked at once a second, pushed only when it changed
_json = msgspec.json.Encoder()


def _static(name: str) -> bytes:
    return resources.files("orchestrator.admin.static").joinpath(name).read_bytes()


class AdminController(Controller):
    """``/admin``: the page, its script, the live event stream and slot messages."""

    path = "/admin"

    @get("/", summary="The admin page (HTML)", media_type=MediaType.HTML, responses=ERROR_RESPONSES)
    async def page(self, request: Request[Any, Any, Any], services: Services) -> Response[bytes]:
        require_admin(request.scope, services.settings.admin_key)
        return Response(_static("admin.html"), media_type="text/html; charset=utf-8")

    @get("/admin.js", summary="The admin page's script", include_in_schema=False)
    async def script(self) -> Response[bytes]:
        return Response(_static("admin.js"), media_type="text/javascript; charset=utf-8")

    @get(
        "/api/slots",
        summary="Every slot: place, tokens, bytes, messages, last use, owner node",
        responses=ERROR_RESPONSES,
    )
    async def slots(self, request: Request[Any, Any, Any], services: Services) -> list[SlotView]:
        require_admin(request.scope, services.settings.admin_key)
        return await AdminView(services).slots()

    @get(
        "/api/slots/{slot_id:str}/messages",
        summary="A slot's messages as text with token ranges",
        responses=ERROR_RESPONSES,
    )
    async def messages(self, request: Request[Any, Any, Any], services: Services, slot_id: str) -> SlotMessages:
        require_admin(request.scope, services.settings.admin_key)
        return msgspec.convert(await AdminView(services).messages_of(slot_id), SlotMessages)

    @get(
        "/events",
        summary="Live slot listing and attention rows (server-sent events)",
        responses=event_stream("slots listings and attention rows, until the client leaves"),
    )
    async def events(
        self,
        request: Request[Any, Any, Any],
        services: Services,
        layer: int | None = Parameter(query="layer", default=None),
    ) -> ServerSentEvent:
        require_admin(request.scope, services.settings.admin_key)
        n_layers = services.generation.info.num_layers
        if layer is not None and not 0 <= layer < n_layers:
            raise ApiError(ErrorCode.INVALID_REQUEST, f"layer must be in 0..{n_layers - 1}")
        view = AdminView(services)
        feed = services.feed

        async def stream() -> AsyncIterator[JsonEvent]:
            last = b""
            next_listing = 0.0
            sub = feed.subscribe(layer)  # here, so that the finally below always drops it
            try:
                while True:
                    now = time.monotonic()
                    if now >= next_listing:
                        next_listing = now + LISTING_EVERY_S
                        try:
                            slots = await view.slots()
                        except Exception as exc:  # engine restarting, store down: say so, keep the stream
                            listing = _json.encode(ErrorEvent.of(report(exc, route_of(request))))
                        else:
                            listing = _json.encode(SlotsEvent(node=view.node_id(), slots=slots))
                        if listing != last:
                            last = listing
                            yield JsonEvent(data=listing)
                    try:
                        row = await asyncio.wait_for(sub.queue.get(), max(0.01, next_listing - time.monotonic()))
                    except TimeoutError:
                        continue
                    yield json_event(AttentionEvent.of(row))
            finally:
                feed.unsubscribe(sub)

        return ServerSentEvent(stream(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
