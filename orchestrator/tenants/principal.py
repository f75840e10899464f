"""The principal a request acts for: its tenant and its role.

Every slot belongs to one tenant; a request sees and touches only its tenant's slots and caches
(docs/operations.md, "Tenants").  The authentication middleware resolves the principal once per
request and stores it in the ASGI scope's ``state``; everything below the HTTP edge is handed the
:class:`Principal` (or its ``tenant``) explicitly.
"""

from __future__ import annotations

from typing import Any

import msgspec

DEFAULT_TENANT = "default"
"""The tenant of a server with no keys, or with the single ``--api-key``: everyone is this one tenant."""

SCOPE_KEY = "slotserve.principal"
"""Where the authentication middleware leaves the request's :class:`Principal` in ``scope["state"]``."""


class Principal(msgspec.Struct, frozen=True):
    """Who a request acts for.

    Attributes:
        tenant: the tenant's name (``[A-Za-z0-9._-]``, 1-64 characters); slot ids, store keys, caches and
            metrics are scoped by it.
        admin: the ``admin`` role: sees every tenant's slots, and may use the admin API and page.
    """

    tenant: str = DEFAULT_TENANT
    admin: bool = False


DEFAULT_PRINCIPAL = Principal()


def principal_of(scope: Any) -> Principal:
    """The principal the authentication middleware resolved for this request (an ASGI scope, or a
    Litestar ``Request``/``WebSocket`` whose ``.scope`` is one); :data:`DEFAULT_PRINCIPAL` when none was
    set (no keys configured)."""
    scope = getattr(scope, "scope", scope)
    state = scope.get("state") or {}
    principal = state.get(SCOPE_KEY)
    return principal if isinstance(principal, Principal) else DEFAULT_PRINCIPAL


def principal_if_known(scope: Any) -> Principal | None:
    """The principal the authentication middleware resolved, or None when it set none (a public route
    called without a valid key while keys are configured).  ``scope``: as :func:`principal_of`."""
    scope = getattr(scope, "scope", scope)
    principal = (scope.get("state") or {}).get(SCOPE_KEY)
    return principal if isinstance(principal, Principal) else None
