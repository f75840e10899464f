"""Lease tokens and an in-process lease table (the single-machine lease backend).

A lease token is ``f"{owner}#{32 hex chars}"``: it names its owner (so the stored value alone answers
:meth:`lease_owner`) and is unguessable (so only the holder can renew or release).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

__all__ = ["LeaseTable", "check_ttl_ms", "make_token", "token_owner"]


def make_token(owner: str) -> str:
    """A fresh lease token for ``owner``."""
    if not isinstance(owner, str):
        raise TypeError("lease owner must be str")
    return f"{owner}#{secrets.token_hex(16)}"


def token_owner(token: str) -> str:
    """The owner part of a token made by :func:`make_token`."""
    return token.rpartition("#")[0]


def check_ttl_ms(ttl_ms: int) -> int:
    """Validate a lease TTL in milliseconds (must be a positive int)."""
    if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0:
        raise ValueError(f"lease ttl_ms must be a positive int, got {ttl_ms!r}")
    return ttl_ms


@dataclass(slots=True)
class _Lease:
    token: str
    expires: float  # time.monotonic() seconds


class LeaseTable:
    """Leases held in this process's memory, with the same semantics as the Redis leases.

    Not thread-safe; use from one event loop (all methods are synchronous and non-blocking).
    """

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}

    def _live(self, key: str) -> _Lease | None:
        lease = self._leases.get(key)
        if lease is not None and lease.expires <= time.monotonic():
            del self._leases[key]
            return None
        return lease

    def acquire(self, key: str, owner: str, ttl_ms: int) -> str | None:
        """Token on success (the existing one if ``owner`` already holds it), None if held by another."""
        check_ttl_ms(ttl_ms)
        lease = self._live(key)
        if lease is not None:
            if token_owner(lease.token) != owner:
                return None
            lease.expires = time.monotonic() + ttl_ms / 1000
            return lease.token
        token = make_token(owner)
        self._leases[key] = _Lease(token, time.monotonic() + ttl_ms / 1000)
        return token

    def holds(self, key: str, token: str) -> bool:
        """True if ``token`` holds the live lease of ``key`` (a fencing check)."""
        lease = self._live(key)
        return lease is not None and lease.token == token

    def renew(self, key: str, token: str, ttl_ms: int) -> bool:
        """Extend to ``ttl_ms`` from now if ``token`` holds the lease."""
        check_ttl_ms(ttl_ms)
        lease = self._live(key)
        if lease is None or lease.token != token:
            return False
        lease.expires = time.monotonic() + ttl_ms / 1000
        return True

    def release(self, key: str, token: str) -> bool:
        """Drop the lease if ``token`` holds it."""
        lease = self._live(key)
        if lease is None or lease.token != token:
            return False
        del self._leases[key]
        return True

    def owner(self, key: str) -> str | None:
        """Owner of the live lease, or None."""
        lease = self._live(key)
        return None if lease is None else token_owner(lease.token)
