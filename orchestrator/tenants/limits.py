"""Per-tenant limits: generations at once, resident slots (engine sequences) and stored bytes.

Each limit is a ``slotserve serve`` flag (0: none): ``--tenant-generations``,
``--tenant-resident`` and ``--tenant-stored-bytes`` (docs/operations.md, "Tenants").  A request
over a limit is refused with ``RATE_LIMITED`` (HTTP 429, ``Retry-After`` and ``error_code``) and
changes nothing; each refusal is counted in ``slotserve_tenant_refused_total{tenant,limit}``.
The limits hold per node: the stored bytes counted are those of the slots this node knows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from contract.errors import ErrorCode
from orchestrator import metrics
from orchestrator.service_error import ServiceError


class TenantLimits:
    """``generations``: generations one tenant may run at once; ``resident``: engine sequences its
    slots may hold at once; ``stored_bytes``: bytes of stored slot state it may keep (0: no limit).
    ``retry_after_s``: the ``Retry-After`` a refused client is told, seconds."""

    def __init__(self, generations: int = 0, resident: int = 0, stored_bytes: int = 0, retry_after_s: int = 1) -> None:
        self.generations = generations
        self.resident = resident
        self.stored_bytes = stored_bytes
        self.retry_after_s = retry_after_s
        self.active: Counter[str] = Counter()  # tenant -> generations running now

    def refuse(self, tenant: str, limit: str, message: str) -> ServiceError:
        """Count and build the ``RATE_LIMITED`` refusal of ``tenant`` over ``limit``."""
        metrics.TENANT_REFUSED.labels(tenant, limit).inc()
        return ServiceError(ErrorCode.RATE_LIMITED, message, retry_after=self.retry_after_s)

    @contextmanager
    def generation(self, tenant: str) -> Iterator[None]:
        """Hold one of ``tenant``'s generation places while the block runs (``RATE_LIMITED`` at entry
        when it already runs ``generations``)."""
        if self.generations and self.active[tenant] >= self.generations:
            raise self.refuse(
                tenant, "generations", f"tenant {tenant!r} already runs {self.generations} generations (its limit)"
            )
        self.active[tenant] += 1
        metrics.TENANT_GENERATIONS_ACTIVE.labels(tenant).set(self.active[tenant])
        try:
            yield
        finally:
            self.active[tenant] -= 1
            metrics.TENANT_GENERATIONS_ACTIVE.labels(tenant).set(self.active[tenant])
            if not self.active[tenant]:
                del self.active[tenant]

    def check_stored(self, tenant: str, stored: int) -> None:
        """``RATE_LIMITED`` when ``tenant``'s slots already take ``stored`` bytes, at or over its limit."""
        metrics.TENANT_STORED_BYTES.labels(tenant).set(stored)
        if self.stored_bytes and stored >= self.stored_bytes:
            raise self.refuse(
                tenant,
                "stored_bytes",
                f"tenant {tenant!r} stores {stored} bytes of slot state, its limit is {self.stored_bytes}:"
                " erase slots it no longer needs",
            )

    def over_resident(self, n_resident: int) -> bool:
        """True when a tenant whose slots hold ``n_resident`` sequences may not take another."""
        return bool(self.resident) and n_resident >= self.resident
