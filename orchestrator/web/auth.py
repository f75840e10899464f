"""Who a request acts for: API keys (llama-server's ``Authorization: Bearer KEY``) and a trusted
gateway's tenant header, resolved to a :class:`orchestrator.tenants.principal.Principal`.

A key is accepted as ``Authorization: Bearer KEY``, ``X-Api-Key: KEY``, ``X-Admin-Key: KEY``
and, for browser WebSockets that cannot set headers, ``?api_key=KEY`` / ``?admin_key=KEY``.
Keys come from ``--api-key`` (the one tenant :data:`~orchestrator.tenants.principal.DEFAULT_TENANT`),
``--admin-key`` (its admin) and ``--api-keys FILE`` (:mod:`orchestrator.tenants.keys`); a gateway's
tenant header from :mod:`orchestrator.tenants.gateway`.  ``/metrics`` holds every tenant's figures
(label ``tenant``): it needs the admin role once keys or a gateway are configured (llama-server's
``/metrics`` needs its ``--api-key`` too; Prometheus sends one with ``authorization`` in its scrape
config), and is open without.  ``/health``, the admin page's static script, the chat page (``/`` and
``/webui/*``: static files, no data) and CORS preflights are public: never refused, but a public
HTTP request that presents a valid key (or comes with no key configured) gets its principal too, so
``/health`` counts only the caller's tenant's slots
(:func:`~orchestrator.tenants.principal.principal_if_known` is None for a caller who shows none).

The middleware leaves the principal in ``scope["state"][SCOPE_KEY]``
(:func:`~orchestrator.tenants.principal.principal_of` reads it).  With no key configured everyone is
one tenant with the admin role, as before tenants existed (README, "Tenants").  A refused HTTP
request gets 401 ``UNAUTHORIZED``; a refused WebSocket is accepted, told
``{"type":"error","error_code":"UNAUTHORIZED"}`` and closed with 1008.
"""

from __future__ import annotations

import contextlib
from typing import Any
from urllib.parse import parse_qs

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send

from contract.errors import ErrorCode
from orchestrator.tenants.gateway import TenantHeader, UntrustedHeader
from orchestrator.tenants.keys import KeyRing
from orchestrator.tenants.principal import DEFAULT_TENANT, SCOPE_KEY, Principal, principal_of
from orchestrator.web.errors import ApiError, ErrorEvent, send_error

PUBLIC_PATHS = ("/health", "/v1/health", "/admin/admin.js", "/")
OPERATOR_PATHS = ("/metrics",)  # every tenant's figures: the admin role once keys or a gateway are configured
PUBLIC_PREFIXES = ("/webui/",)  # the chat page's static assets (orchestrator/webui): they hold no data


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _presented_keys(scope: Scope, headers: dict[str, str]) -> list[str]:
    keys = []
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        keys.append(auth[7:].strip())
    keys += [headers[h].strip() for h in ("x-api-key", "x-admin-key") if h in headers]
    qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return keys + qs.get("api_key", []) + qs.get("admin_key", [])


class Authenticator:
    """Resolves a request's principal from ``keys`` and, if set, a gateway's ``tenant_header``.

    A presented key that is known wins; else a trusted tenant header; else, when neither keys nor a
    tenant header are configured, the one tenant with the admin role; with only a tenant header
    configured, a request without it is :data:`DEFAULT_TENANT` with the user role.
    """

    def __init__(self, keys: KeyRing, tenant_header: TenantHeader | None = None) -> None:
        self.keys = keys
        self.tenant_header = tenant_header
        self.open = Principal(DEFAULT_TENANT, admin=tenant_header is None)

    def resolve(self, scope: Scope) -> Principal:
        """The request's principal, or :class:`ApiError` ``UNAUTHORIZED`` (see the class docstring)."""
        headers = _headers(scope)
        presented = _presented_keys(scope, headers)
        found = self.keys.lookup(presented)
        if found is not None:
            return found
        if self.tenant_header is not None:
            client = scope.get("client")
            try:
                named = self.tenant_header.principal(headers, client[0] if client else None)
            except UntrustedHeader as exc:
                raise ApiError(ErrorCode.UNAUTHORIZED, str(exc)) from None
            if named is not None:
                return named
        if self.keys.configured:
            raise ApiError(ErrorCode.UNAUTHORIZED, "Invalid or missing API key")
        return self.open


def _admin_needed() -> ApiError:
    return ApiError(
        ErrorCode.UNAUTHORIZED,
        "this needs the admin role: an admin key (--admin-key or an 'admin' line of --api-keys),"
        " as Bearer, X-Admin-Key or ?admin_key=",
    )


def require_admin(scope: Any) -> None:
    """Raise ``UNAUTHORIZED`` (401) unless the request's principal has the admin role (``scope``: an
    ASGI scope or a Litestar request)."""
    if not principal_of(scope).admin:
        raise _admin_needed()


def auth_middleware(auth: Authenticator):  # type: ignore[no-untyped-def]
    """ASGI middleware factory: resolve every HTTP and WebSocket request's principal with ``auth``
    (see module docstring)."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            kind = scope["type"]
            path = scope["path"]
            public = path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)
            if kind not in ("http", "websocket") or public or scope.get("method") == "OPTIONS":
                if public and kind == "http":  # never refused; a caller who shows a key sees its own
                    with contextlib.suppress(ApiError):
                        scope.setdefault("state", {})[SCOPE_KEY] = auth.resolve(scope)  # type: ignore[typeddict-unknown-key]
                await app(scope, receive, send)
                return
            try:
                principal = auth.resolve(scope)
                if path in OPERATOR_PATHS and not principal.admin:
                    raise _admin_needed()
            except ApiError as err:
                if kind == "http":
                    await send_error(send, scope["path"], err, [(b"www-authenticate", b"Bearer")])
                    return
                await receive()  # websocket.connect
                await send({"type": "websocket.accept", "subprotocol": None, "headers": []})
                frame = msgspec.json.encode(ErrorEvent.of(err)).decode()
                await send({"type": "websocket.send", "bytes": None, "text": frame})
                await send({"type": "websocket.close", "code": 1008, "reason": None})
                return
            scope.setdefault("state", {})[SCOPE_KEY] = principal  # type: ignore[typeddict-unknown-key]
            await app(scope, receive, send)

        return middleware

    return wrap
