"""Ownership of slots between nodes: store sync, lease fencing and disowning.

With several nodes on one store (docs/operations.md, "Several nodes"), a node owns a slot only
under its lease (:class:`orchestrator.slots.leases.LeaseKeeper`).  :class:`Ownership` keeps what
this node knows of a slot honest against the store:

* whenever the lease is taken anew, the slot is checked against the store's metadata
  (``Slot.synced``: the ``(generation, digest)`` this node's copy comes from) and replaced by it
  when another node wrote meanwhile: a stale resident copy is erased, never served
  (:meth:`Ownership.claim`);
* every write and delete carries the lease token as a fencing token (:meth:`Ownership.fence`);
  a lease that lapsed while this node held the slot (a pause, a store outage longer than the
  lease) is taken back when no other node took it and the store still holds the version this
  node's copy comes from;
* a refused write drops this node's copy (:meth:`Ownership.disown`, :meth:`Ownership.drop_copy`).

Without leases (one node) every method is a no-op or answers "ours".  It knows no lookup and
no durability: residency is its one member (to erase a dropped copy's cells).
"""

from __future__ import annotations

import structlog

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError
from orchestrator.slots.leases import LeaseKeeper
from orchestrator.slots.model import Slot
from orchestrator.slots.persistence import SlotArchive
from orchestrator.slots.residency import Residency
from storage.base import SlotMeta, state_bytes, stored_bytes

log = structlog.get_logger("slotserve.slots")


def stored_version(meta: SlotMeta | None) -> tuple[int, str]:
    """The stored version ``meta`` describes, as ``Slot.synced`` records it (``(0, "")``: nothing stored)."""
    return (meta.generation, meta.digest) if meta is not None else (0, "")


def take_meta(slot: Slot, meta: SlotMeta | None) -> None:
    """Know of ``slot`` what the store's ``meta`` says (None: nothing stored)."""
    slot.stored = meta is not None
    slot.n_tokens = meta.n_tokens if meta is not None else 0
    slot.stored_bytes = stored_bytes(meta) if meta is not None else 0
    slot.raw_bytes = state_bytes(meta) if meta is not None else 0
    slot.synced = stored_version(meta)
    if meta is not None:
        slot.partition = meta.partition


class Ownership:
    """This node's claim on slots (see module docstring).

    ``archive``: the store (None: nothing stored, every slot is this node's); ``leases``: the
    node's lease keeper (None: one node); ``residency``: whose sequences a dropped copy frees.
    """

    def __init__(self, archive: SlotArchive | None, leases: LeaseKeeper | None, residency: Residency) -> None:
        self.archive = archive
        self.leases = leases
        self.residency = residency

    async def claim(self, slot: Slot) -> None:
        """Hold ``slot``'s lease (lock held); when it was taken now, sync with the store first.

        ``SLOT_BUSY`` (another node holds it), ``STORE_UNAVAILABLE``."""
        if self.leases is not None and await self.leases.claim(slot.key):
            await self._sync(slot)

    async def _sync(self, slot: Slot) -> None:
        """The lease of ``slot`` (lock held) was just taken: unless the store still holds the
        version this node's copy comes from, drop the copy and take the store's metadata.  On
        failure the lease is given up again, so the next claim syncs anew."""
        assert self.archive is not None and self.leases is not None
        try:
            meta = await self.archive.lookup(slot.key)
        except BaseException:
            await self.leases.release(slot.key)
            raise
        seen = stored_version(meta)
        if seen == slot.synced:
            return
        if slot.synced is not None or self.residency.is_resident(slot):
            log.info("slot changed in the store since this node saw it", slot_id=slot.id, stored=seen)
        await self.drop_copy(slot)
        take_meta(slot, meta)

    async def drop_copy(self, slot: Slot, grant: bool = True) -> None:
        """Forget this node's copy of ``slot`` (lock held): erase its cells, free its sequence
        (handed to the queue unless not ``grant``: the caller takes it); what it holds is then
        unknown (``synced`` None) until the store is asked.  A pending write-behind of it finds
        it clean and is dropped."""
        await self.residency.vacate(slot, grant=grant)
        slot.dirty, slot.stored, slot.n_tokens, slot.synced = False, False, 0, None

    async def fence(self, slot: Slot) -> str | None:
        """The lease token that fences writes of ``slot`` (lock held; None without leases: one
        node).  A lease that lapsed while this node held the slot (a pause, a store outage
        longer than the lease) is taken back when no other node took it and the store still
        holds the version this node's copy comes from; else ``OwnershipLost`` (refused, counted).
        ``STORE_UNAVAILABLE`` when the store cannot be asked."""
        if self.leases is None:
            return None
        if not self.leases.holds(slot.key) and slot.synced is not None:
            await self._take_back(slot)
        return self.leases.token(slot.key)

    async def retake(self, slot: Slot) -> str | None:
        """A write of ``slot`` (lock held or its snapshot taken) with this node's lease token was
        refused because the lease lapsed (a store outage or a pause longer than the lease, the
        heartbeat not yet aware): take the lease back as :meth:`fence` does, when no other node
        holds it and the store still holds the version this node's copy comes from.  The new
        token, or None (the slot is another node's, or changed).  ``STORE_UNAVAILABLE``."""
        if self.leases is None or slot.synced is None:
            return None
        self.leases.forget(slot.key)
        return self.leases.token(slot.key) if await self._take_back(slot) else None

    async def _take_back(self, slot: Slot) -> bool:
        """Claim the lapsed lease of ``slot`` and keep it only if the stored version is unchanged."""
        assert self.archive is not None and self.leases is not None
        try:
            if not await self.leases.claim(slot.key):
                return True  # held already
        except ServiceError as exc:
            if exc.code != ErrorCode.SLOT_BUSY:
                raise
            return False  # another node holds it
        try:
            unchanged = stored_version(await self.archive.lookup(slot.key)) == slot.synced
        except BaseException:
            await self.leases.release(slot.key)
            raise
        if not unchanged:
            await self.leases.release(slot.key)
            return False
        log.info("lease taken back: nobody wrote the slot meanwhile", slot_id=slot.id, tenant=slot.tenant)
        return True

    def disown(self, slot: Slot) -> None:
        """A write of ``slot`` was refused: it is another node's now.  Its lease is forgotten and
        its copy marked unknown (the caller erases the cells under the slot's lock)."""
        if self.leases is not None:
            self.leases.forget(slot.key)
        slot.dirty, slot.synced = False, None

    async def release(self, slot: Slot) -> None:
        """Give up ``slot``'s lease (parked or deleted: any node may take it)."""
        if self.leases is not None:
            await self.leases.release(slot.key)
