"""Durability of slots: the write-behind, the strict commit of a turn, and flushing.

After every completed generation or change a slot is *scheduled*: a coalescing write-behind
(:class:`orchestrator.slots.background.WriteBehind`, one save per burst, ``--write-delay-ms``)
reads its state from the engine under the slot's lock and writes it to the store after the lock
is released, so a slow store never blocks the slot's next turn.  With ``strict`` durability
(``--durability strict``, docs/operations.md) a turn's answer waits until its state is stored
(:meth:`Durability.commit_turn`).  Every write is fenced by the slot's lease
(:class:`orchestrator.slots.ownership.Ownership`); a refused one disowns the slot.

Where the store keeps KV chunks and the model's state is KV caches only, a save stores the state
incrementally (:mod:`orchestrator.slots.increments`): the chunks the turn's new tokens touched and the
metadata naming all of them, so a turn's cost follows its new tokens, not its context.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from orchestrator import metrics
from orchestrator.engine_client.interface import EngineClient
from orchestrator.slots.background import WriteBehind
from orchestrator.slots.increments import ChunkedSnapshot, Increments
from orchestrator.slots.model import Slot
from orchestrator.slots.ownership import Ownership
from orchestrator.slots.persistence import OwnershipLost, SlotArchive
from orchestrator.slots.residency import Residency
from slotstate.ses1 import pack_ses1
from storage.base import SlotMeta, state_bytes, stored_bytes

Snapshot = tuple[list[int], bytes] | ChunkedSnapshot
"""What a save stores: ``(tokens, ses1)`` (whole) or a :class:`ChunkedSnapshot` (incremental)."""


class Durability:
    """Saves of slots to ``archive`` (see module docstring).

    ``find(key)``: the slot stored under ``key`` (:attr:`Slot.key`) or None; ``strict``: a turn is
    answered once stored; ``write_delay_s``: how long the write-behind waits to coalesce saves.
    """

    def __init__(
        self,
        engine: EngineClient,
        archive: SlotArchive,
        residency: Residency,
        ownership: Ownership,
        find: Callable[[str], Slot | None],
        *,
        strict: bool,
        write_delay_s: float,
    ) -> None:
        self.engine = engine
        self.archive = archive
        self.residency = residency
        self.ownership = ownership
        self.find = find
        self.strict = strict
        self.pending: set[str] = set()  # keys of slots changed since their last save
        self.increments = Increments(engine, archive)
        self.saver = WriteBehind(self.flush, lambda: bool(self.pending), write_delay_s)

    def schedule(self, slot: Slot) -> None:
        """Mark ``slot`` changed and queue a save (coalesced with others for it)."""
        slot.dirty = True
        self.pending.add(slot.key)
        self.saver.wake()

    async def commit_turn(self, slot: Slot) -> None:
        """With ``strict`` durability, store the slot's state (lock held) before its turn is
        answered: ``STORE_UNAVAILABLE`` or ``SLOT_BUSY`` (ownership lost) instead of an answer
        that a crash could lose.  Nothing to do otherwise."""
        if not self.strict:
            return
        n_tokens, t0 = slot.n_tokens, time.perf_counter()
        try:
            meta = await self.save(slot, flush=False)
        except OwnershipLost:
            await self.ownership.drop_copy(slot)
            raise
        metrics.DURABLE_COMMIT_SECONDS.observe(time.perf_counter() - t0)
        if meta is not None and meta.n_tokens < n_tokens:
            # an incremental commit leaves the last generated token's write (a decode step the idle
            # worker makes 50 ms later) out of the turn; the write-behind stores that token, off the turn
            slot.n_tokens = n_tokens
            self.schedule(slot)

    async def _fence(self, slot: Slot) -> str | None:
        try:
            return await self.ownership.fence(slot)
        except OwnershipLost:
            self.ownership.disown(slot)
            raise

    async def save(self, slot: Slot, flush: bool = True) -> SlotMeta | None:
        """Persist a resident slot (lock held by the caller) now; ``STORE_UNAVAILABLE`` if it
        cannot, ``SLOT_BUSY`` (:class:`OwnershipLost`: disowned, the caller drops the copy) if
        it is not ours.  ``flush`` False: an incremental save leaves the last generated token's
        pending write out (:meth:`Increments.snapshot`)."""
        lease = await self._fence(slot)
        version = self.archive.next_version()
        snap = await self._snapshot(slot, flush, write_ahead=True)  # the lock is held until written anyway
        slot.dirty = False  # from here; write marks it dirty again if the write fails
        return await self.write(slot, snap, version, lease)

    async def save_copy(self, slot: Slot, tokens: list[int], ses1: bytes) -> SlotMeta | None:
        """Store the SES1 blob ``ses1`` of ``tokens`` as ``slot``'s state (lock held; a fork made
        in the store), fenced by its lease."""
        slot.dirty = False
        return await self.write(slot, (tokens, ses1), self.archive.next_version(), await self._fence(slot))

    async def ensure_saved(self, slot: Slot) -> None:
        """Before ``slot`` (lock held) leaves the engine: wait for a write in flight, then save
        it if the store does not hold its current state (``STORE_UNAVAILABLE`` if it cannot)."""
        await self.archive.settled(slot.key)  # a background write that fails marks the slot dirty again
        if slot.dirty or (slot.n_tokens and not slot.stored):
            await self.save(slot)

    async def _snapshot(
        self, slot: Slot, flush: bool = True, known: dict[str, int] | None = None, write_ahead: bool = False
    ) -> Snapshot:
        """What a save of ``slot`` (resident, lock held) stores: incremental where it applies (``flush``,
        ``known`` and ``write_ahead``: :meth:`Increments.snapshot`'s)."""
        if self.increments.applies():
            snap = await self.increments.snapshot(slot, flush, known, write_ahead)
            if snap is not None:
                return snap
        return await self._read_state(slot)

    async def _read_state(self, slot: Slot) -> tuple[list[int], bytes]:
        saved = await self.engine.save_state(slot.seq)  # type: ignore[arg-type]
        try:
            ses1 = await asyncio.to_thread(pack_ses1, saved.tokens, saved.state)  # a copy of megabytes
        finally:
            self.engine.release_state(saved.state)  # copied into the blob: its receive buffer serves the next state
        return saved.tokens, ses1

    async def write(self, slot: Slot, snap: Snapshot, version: int, lease: str | None) -> SlotMeta | None:
        """Store a snapshot (whole or incremental) fenced by ``lease`` (unless a newer one is stored: None); on failure
        the slot is dirty again and queued for the write-behind.  A refusal whose lease only lapsed
        (nobody took it, the stored version unchanged: :meth:`Ownership.retake`) is written again
        under the lease taken back; any other refusal (``OwnershipLost``) disowns the slot."""

        async def put(token: str | None) -> SlotMeta | None:
            if isinstance(snap, ChunkedSnapshot):
                return await self.archive.write_chunks(
                    slot.key, snap.tokens, snap.chunks, snap.new, snap.rest, version, token,
                    tenant=slot.tenant, partition=slot.partition, ready=snap.writing,
                )  # fmt: skip
            return await self.archive.write(
                slot.key, snap[0], snap[1], version, token, tenant=slot.tenant, partition=slot.partition
            )

        try:
            try:
                meta = await put(lease)
            except OwnershipLost:
                retaken = await self.ownership.retake(slot) if lease is not None else None
                if retaken is None:
                    raise
                meta = await put(retaken)
        except OwnershipLost:
            self.ownership.disown(slot)
            raise
        except BaseException:
            slot.dirty = True
            self.pending.add(slot.key)
            raise
        finally:
            if isinstance(snap, ChunkedSnapshot):
                await snap.settle()  # chunk writes a refused or skipped commit never waited for
        if meta is not None:
            if isinstance(snap, ChunkedSnapshot):
                self.increments.stored(slot, snap, meta)
            slot.stored, slot.synced = True, (meta.generation, meta.digest)
            slot.stored_bytes, slot.raw_bytes = stored_bytes(meta), state_bytes(meta)
            if not slot.dirty:
                slot.n_tokens = meta.n_tokens
        return meta

    async def flush(self, wait_for_locks: bool = False) -> int:
        """Save every dirty resident slot now (busy ones only with ``wait_for_locks``); how many were saved."""
        saved = 0
        for key in list(self.pending):
            slot = self.find(key)
            if slot is None or not slot.dirty or not self.residency.is_resident(slot):
                self.pending.discard(key)
                continue
            if (slot.lock.locked() or slot.busy) and not wait_for_locks:
                continue  # busy: its own end schedules it again
            known = await self.increments.known(slot) if self.increments.applies() else None  # no store call locked
            async with slot.lock:  # held only to read the state: the write happens after
                if not (slot.dirty and self.residency.is_resident(slot)):
                    self.pending.discard(key)
                    continue
                try:
                    lease = await self._fence(slot)
                except OwnershipLost:
                    await self.ownership.drop_copy(slot)
                    continue
                version = self.archive.next_version()
                snap = await self._snapshot(slot, known=known)
                slot.dirty = False
                self.pending.discard(key)
            try:
                if await self.write(slot, snap, version, lease) is not None:
                    saved += 1
            except OwnershipLost:
                async with slot.lock:
                    if slot.synced is None:  # not taken back (and synced) meanwhile
                        await self.ownership.drop_copy(slot)
        return saved
