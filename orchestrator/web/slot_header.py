"""``X-Slot-Id``: the slot a generation used, on the HTTP answer of every generating route.

A request that names no slot gets one chosen by the server (:mod:`orchestrator.anonymous`); the
header tells the client which, so it can name it next time (docs/api.md, "Requests without a slot
id").  Handlers hand the request's :class:`orchestrator.generation.RunControl` to
:func:`watch_slot` (``cancelled_on_disconnect`` does, for every generation and preview); the
middleware adds the header when the answer starts, if a slot was chosen by then.  A slot id that
is not ASCII is sent percent-encoded (UTF-8, RFC 3986), as a header value must be ASCII.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

from litestar.types import ASGIApp, Message, Receive, Scope, Send


class RunControl(Protocol):
    """What the header needs of a run (:class:`orchestrator.generation.service.RunControl` is one): the slot
    it was given, None until the server chose one."""

    @property
    def slot_id(self) -> str | None: ...


HEADER = b"x-slot-id"
_SCOPE_KEY = "slotserve.run_control"


def watch_slot(scope: Any, control: RunControl) -> None:
    """Report ``control.slot_id`` in the answer to the request of ``scope`` (its ASGI scope)."""
    scope[_SCOPE_KEY] = control


def header_value(slot_id: str) -> bytes:
    """The header's value for ``slot_id``: as it is when ASCII, else percent-encoded UTF-8."""
    return quote(slot_id, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")).encode("ascii")


def slot_header_middleware(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: adds ``X-Slot-Id`` to HTTP answers whose request used a slot."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_with_slot(message: Message) -> None:
            if message["type"] == "http.response.start":
                control: RunControl | None = scope.get(_SCOPE_KEY)  # type: ignore[assignment]
                if control is not None and control.slot_id is not None:
                    headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                    message["headers"] = [*headers, (HEADER, header_value(control.slot_id))]
            await send(message)

        await app(scope, receive, send_with_slot)

    return middleware
