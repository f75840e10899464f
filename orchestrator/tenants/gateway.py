"""The tenant header of a trusted gateway (``--tenant-header NAME``).

Behind an API gateway that authenticates its users itself, the gateway names the tenant in a
header, and slotserve believes it only from the gateway: when the request also carries the
shared secret (``--gateway-secret``, sent in the ``X-Gateway-Secret`` header) or comes from one
of the listed client addresses (``--gateway-from``, addresses or CIDR networks such as
``10.0.0.0/8``; the peer address of the TCP connection, never ``X-Forwarded-For``).  A tenant header
from anywhere else is refused (401), so a client cannot name itself another tenant
(docs/operations.md, "Tenants").  A tenant named by the header has the user role.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping

from orchestrator.tenants.keys import check_tenant
from orchestrator.tenants.principal import Principal

SECRET_HEADER = "x-gateway-secret"
"""The header a gateway sends ``--gateway-secret`` in."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class UntrustedHeader(Exception):
    """The tenant header came from a source that is not the gateway, or names no valid tenant."""


def parse_networks(items: tuple[str, ...]) -> tuple[Network, ...]:
    """``--gateway-from``'s addresses and networks (``ValueError`` for one that is neither)."""
    return tuple(ipaddress.ip_network(i.strip(), strict=False) for i in items if i.strip())


class TenantHeader:
    """``name``: the header (any case) that names the tenant; ``secret``: the shared secret the
    gateway sends in :data:`SECRET_HEADER`; ``networks``: client addresses the header is believed
    from.  With neither ``secret`` nor ``networks`` the header is never believed."""

    def __init__(self, name: str, secret: str | None = None, networks: tuple[Network, ...] = ()) -> None:
        self.name = name.lower()
        self.secret = secret.encode() if secret else None
        self.networks = networks

    def _trusted(self, headers: Mapping[str, str], client: str | None) -> bool:
        presented = headers.get(SECRET_HEADER)
        if self.secret is not None and presented is not None and hmac.compare_digest(presented.encode(), self.secret):
            return True
        if client is None or not self.networks:
            return False
        try:
            addr = ipaddress.ip_address(client)
        except ValueError:  # a Unix socket's peer: not an address
            return False
        return any(addr in net for net in self.networks)

    def principal(self, headers: Mapping[str, str], client: str | None) -> Principal | None:
        """The principal the header names (None: the request has no such header).  Raises
        :class:`UntrustedHeader` when it is present but not from the gateway, or names no valid
        tenant.  ``headers``: lower-case names; ``client``: the TCP peer's address."""
        value = headers.get(self.name)
        if value is None:
            return None
        if not self._trusted(headers, client):
            raise UntrustedHeader(f"the {self.name} header is believed only from the gateway")
        try:
            return Principal(tenant=check_tenant(value.strip()))
        except ValueError as exc:
            raise UntrustedHeader(f"{self.name}: {exc}") from None
