"""API key check (``--api-key``), like llama-server's: ``Authorization: Bearer KEY``.

Also accepted: ``X-Api-Key: KEY`` and, for browser WebSockets that cannot set
headers, ``?api_key=KEY``.  ``/health``, ``/metrics``, the admin page's static script,
the chat page (``/`` and ``/webui/*``: static files, no data) and CORS preflights are
public.  The admin key (``--admin-key``; ``X-Admin-Key``, ``Bearer`` or ``?admin_key=``)
passes wherever the API key does, and is required by
:func:`require_admin` for the admin page and every slot-changing action.
A refused HTTP request gets 401 ``UNAUTHORIZED``; a refused WebSocket is accepted,
told ``{"type":"error","error_code":"UNAUTHORIZED"}`` and closed with 1008.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send

from contract.errors import ErrorCode
from orchestrator.web.errors import ApiError, ErrorEvent, send_error

PUBLIC_PATHS = ("/health", "/v1/health", "/metrics", "/admin/admin.js", "/")
PUBLIC_PREFIXES = ("/webui/",)  # the chat page's static assets (orchestrator/webui): they hold no data


def _presented_keys(scope: Scope) -> list[str]:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    keys = []
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        keys.append(auth[7:].strip())
    keys += [headers[h].strip() for h in ("x-api-key", "x-admin-key") if h in headers]
    qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return keys + qs.get("api_key", []) + qs.get("admin_key", [])


def _matches(keys: list[str], *wanted: str | None) -> bool:
    return any(hmac.compare_digest(k.encode(), w.encode()) for k in keys for w in wanted if w)


def require_admin(scope: Scope, admin_key: str | None) -> None:
    """Raise ``UNAUTHORIZED`` (401) unless ``admin_key`` is unset or presented (see module docstring)."""
    if admin_key and not _matches(_presented_keys(scope), admin_key):
        raise ApiError(
            ErrorCode.UNAUTHORIZED, "this needs the admin key (--admin-key): X-Admin-Key header or ?admin_key="
        )


def api_key_middleware(api_key: str, admin_key: str | None = None):  # type: ignore[no-untyped-def]
    """ASGI middleware factory enforcing ``api_key`` (or ``admin_key``; see module docstring)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            kind = scope["type"]
            path = scope["path"]
            public = path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)
            if kind not in ("http", "websocket") or public or scope.get("method") == "OPTIONS":
                await app(scope, receive, send)
                return
            if _matches(_presented_keys(scope), api_key, admin_key):
                await app(scope, receive, send)
                return
            err = ApiError(ErrorCode.UNAUTHORIZED, "Invalid or missing API key")
            if kind == "http":
                await send_error(send, scope["path"], err, [(b"www-authenticate", b"Bearer")])
                return
            await receive()  # websocket.connect
            await send({"type": "websocket.accept", "subprotocol": None, "headers": []})
            frame = msgspec.json.encode(ErrorEvent.of(err)).decode()
            await send({"type": "websocket.send", "bytes": None, "text": frame})
            await send({"type": "websocket.close", "code": 1008, "reason": None})

        return middleware

    return wrap
