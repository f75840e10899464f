"""Exceptions raised by the ``storage`` package (the state errors are :mod:`slotstate.errors`'s, re-exported).

Every store and helper raises only these (plus ``ValueError``/``TypeError`` for caller mistakes such as an
invalid slot id), so callers can map them to API errors without knowing the backend:

- :class:`BadStateError`: stored or supplied state is unusable (corrupt, truncated, wrong format).
  The orchestrator reports it as ``BAD_STATE`` and leaves the slot as it was.
- :class:`FingerprintMismatchError`: the state was made by another model/build; never restore it.
- :class:`StoreUnavailableError`: the backend cannot be reached right now (connection refused, timeout,
  failover in progress). Transient: retrying later may succeed.
- :class:`LeaseLostError`: a write fenced by a lease token was refused because that token no longer
  holds the slot's lease (another node owns the slot now, or the lease lapsed). Nothing was written.
"""

from __future__ import annotations

from slotstate.errors import BadStateError, FingerprintMismatchError

__all__ = ["BadStateError", "FingerprintMismatchError", "LeaseLostError", "StorageError", "StoreUnavailableError"]


class StorageError(Exception):
    """Base class of every error raised by the storage package."""


class StoreUnavailableError(StorageError):
    """The state store backend is unreachable or timed out (transient; the operation did not happen
    or its outcome is unknown)."""


class LeaseLostError(StorageError):
    """A fenced write (``put``/``delete`` with ``lease=token``) was refused: ``token`` does not hold the
    slot's lease at the moment of the commit. The check and the commit are one atomic step, so nothing
    of the refused write is stored.

    Attributes:
        slot_id: the slot whose write was refused.
    """

    def __init__(self, slot_id: str) -> None:
        super().__init__(f"slot {slot_id!r}: the writer does not hold its lease; write refused")
        self.slot_id = slot_id
