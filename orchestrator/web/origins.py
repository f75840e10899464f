"""``--allowed-origins`` on every request: the allow-list that CORS answers preflights with.

CORS alone does not stop a browser: a page on another origin may send a "simple" request (a
``POST`` with ``Content-Type: text/plain``, no preflight) that runs before the browser hides the
answer from the page, and browsers do not apply CORS to WebSockets at all.  They do send the
page's ``Origin`` header with both, so a request whose ``Origin`` is neither allowed nor the
server's own host is refused before it reaches a handler: a WebSocket handshake with HTTP 403
(RFC 6455 section 4.2.2: the server may refuse a handshake from an origin it does not accept),
an HTTP request with 403 ``FORBIDDEN``.  Preflights (``OPTIONS``) are left to Litestar's CORS
middleware.  Clients that are not browsers send no ``Origin`` and are not affected.  The list
is Litestar's :class:`~litestar.config.cors.CORSConfig`, so HTTP and WebSockets answer the same
origins; ``*`` allows every origin.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from litestar.config.cors import CORSConfig
from litestar.types import ASGIApp, Message, Method, Receive, Scope, Send

from contract.errors import ErrorCode
from orchestrator.web.errors import ApiError, send_error


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == name), None)


def refused_origin(scope: Scope, cors: CORSConfig) -> str | None:
    """The request's ``Origin`` when ``cors`` refuses it and it is not the server's own host
    (the admin page's own requests carry it), else ``None``."""
    if cors.is_allow_all_origins:
        return None
    origin = _header(scope, b"origin")
    if origin is None or cors.is_origin_allowed(origin):
        return None
    host = _header(scope, b"host")
    if host is not None and urlsplit(origin).netloc.lower() == host.lower():
        return None
    return origin


CORS_METHODS: tuple[Method, ...] = ("GET", "POST", "DELETE", "OPTIONS")
"""The methods a preflight allows, in llama-server's order (llama.cpp ``common/common.h`` ``cors_methods``)."""


async def preflight_ok(message: Message, scope: Scope) -> None:
    """Litestar ``before_send`` hook giving CORS answers llama-server's form (``server-http.cpp``):
    a preflight is answered 200 (Litestar's CORS middleware answers 204 when allowed, 400 when
    refused; a refused origin still gets no ``Access-Control-Allow-Origin``), and an allowed
    origin is named in ``Access-Control-Allow-Origin`` rather than ``*``, as a response with
    ``Access-Control-Allow-Credentials: true`` must (Fetch standard, "CORS check")."""
    if message["type"] != "http.response.start":
        return
    if scope.get("method") == "OPTIONS" and message["status"] in (204, 400):
        message["status"] = 200
    origin = _header(scope, b"origin")
    if origin is not None:
        headers = message.get("headers") or []
        message["headers"] = [(k, _llama_cors_value(k.lower(), v, origin)) for k, v in headers]


def _llama_cors_value(name: bytes, value: bytes, origin: str) -> bytes:
    if name == b"access-control-allow-origin" and value == b"*":
        return origin.encode("latin-1")
    if name == b"access-control-allow-methods":  # Litestar sorts them
        return ", ".join(CORS_METHODS).encode()
    return value


def origin_middleware(cors: CORSConfig) -> Callable[[ASGIApp], ASGIApp]:
    """ASGI middleware factory: requests from an origin ``cors`` refuses get 403 (see the module docstring)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            kind = scope["type"]
            if kind in ("http", "websocket") and scope.get("method") != "OPTIONS":
                origin = refused_origin(scope, cors)
                if origin is not None:
                    if kind == "websocket":
                        await receive()  # websocket.connect
                        await send({"type": "websocket.close", "code": 1008, "reason": None})  # before accept: HTTP 403
                        return
                    err = ApiError(ErrorCode.FORBIDDEN, f"origin {origin!r} is not allowed (--allowed-origins)")
                    await send_error(send, scope["path"], err)
                    return
            await app(scope, receive, send)

        return middleware

    return wrap
