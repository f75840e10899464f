"""``--allowed-origins`` for WebSockets: the allow-list that CORS enforces on HTTP.

Browsers do not apply CORS to WebSockets: a page on any origin may open one to
``localhost``.  They do send the page's ``Origin`` header with the handshake, so a
handshake whose ``Origin`` is not allowed is refused with HTTP 403 before it is accepted
(RFC 6455 section 4.2.2: the server may refuse a handshake from an origin it does not
accept).  Clients that are not browsers send no ``Origin`` and are not affected.  The
list is Litestar's :class:`~litestar.config.cors.CORSConfig`, so HTTP and WebSockets
answer the same origins; ``*`` allows every origin.
"""

from __future__ import annotations

from collections.abc import Callable

from litestar.config.cors import CORSConfig
from litestar.types import ASGIApp, Receive, Scope, Send


def websocket_origin_middleware(cors: CORSConfig) -> Callable[[ASGIApp], ASGIApp]:
    """ASGI middleware factory: WebSocket handshakes from an origin ``cors`` refuses get 403."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "websocket" and not cors.is_allow_all_origins:
                origin = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"origin"), None)
                if origin is not None and not cors.is_origin_allowed(origin):
                    await receive()  # websocket.connect
                    await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
                    return
            await app(scope, receive, send)

        return middleware

    return wrap
