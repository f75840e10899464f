"""API key check (``--api-key``), like llama-server's: ``Authorization: Bearer KEY``.

Also accepted: ``X-Api-Key: KEY`` and, for browser WebSockets that cannot set
headers, ``?api_key=KEY``.  ``/health``, ``/metrics`` and CORS preflights are public.
A refused HTTP request gets 401 ``UNAUTHORIZED``; a refused WebSocket is accepted,
told ``{"type":"error","error_code":"UNAUTHORIZED"}`` and closed with 1008.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send

PUBLIC_PATHS = ("/health", "/v1/health", "/metrics")
# OpenAI's and llama-server's paths answer errors as {"error": {"code", "message", "type"}} (docs/api.md "Errors")
NESTED_ERROR_PATHS = ("/v1/", "/chat/", "/completion", "/models", "/props", "/slots", "/tokenize", "/detokenize")


def _presented_key(scope: Scope) -> str | None:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    if "x-api-key" in headers:
        return headers["x-api-key"].strip()
    qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return qs.get("api_key", [None])[0]


def api_key_middleware(api_key: str):  # type: ignore[no-untyped-def]
    """ASGI middleware factory enforcing ``api_key`` (see module docstring)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            kind = scope["type"]
            if kind not in ("http", "websocket") or scope["path"] in PUBLIC_PATHS or scope.get("method") == "OPTIONS":
                await app(scope, receive, send)
                return
            key = _presented_key(scope)
            if key is not None and hmac.compare_digest(key.encode(), api_key.encode()):
                await app(scope, receive, send)
                return
            message = "Invalid or missing API key"
            body: dict[str, object] = {"error": message, "error_code": "UNAUTHORIZED"}
            if kind == "http":
                if scope["path"].startswith(NESTED_ERROR_PATHS):
                    body["error"] = {"code": 401, "message": message, "type": "authentication_error"}
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                    }
                )
                await send({"type": "http.response.body", "body": msgspec.json.encode(body)})
                return
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": msgspec.json.encode({"type": "error", **body}).decode()})
            await send({"type": "websocket.close", "code": 1008})

        return middleware

    return wrap
