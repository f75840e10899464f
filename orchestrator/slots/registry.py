"""The slot registry: the one owner of slots, their engine sequences and their stored copies.

A slot is a conversation's KV state, addressed by a string id (``"0"`` is the default slot,
numeric ids work like llama-server's).  It is *resident* while it holds an engine sequence
and *parked* when only the store has it.  :class:`SlotRegistry` is the only writer of
:class:`orchestrator.slots.model.Slot` fields and the only caller of KV operations on the engine
(erase, fork, context shift, save and restore state); generation and the slot actions
report back through its methods (:meth:`SlotRegistry.generated`, :meth:`SlotRegistry.restore`,
...).  It:

* serializes use of a slot: one generation or slot action at a time (``SLOT_BUSY``, HTTP 409,
  unless the request asks to wait; a wait is bounded by ``wait_s`` seconds, then
  ``SLOT_BUSY`` too), and holds the slot's lease while it is resident
  (:class:`orchestrator.slots.leases.LeaseKeeper`);
* gives a slot a sequence on demand, parking the least recently used idle slot or queueing
  the request (:class:`orchestrator.slots.residency.Residency`, its base class);
* persists slots through :class:`orchestrator.slots.persistence.SlotArchive`: after every completed
  generation or change, a write-behind task saves it (coalesced: one save per burst,
  :class:`orchestrator.slots.background.WriteBehind`); the slot's lock is held only while its
  state is read from the engine, so a slow store never blocks its next turn.  Idle slots
  are parked after ``--park-idle`` seconds;
* notices a restarted worker (sequences gone) and reloads slots from the store;
* owns a slot only under its lease: whenever it takes the lease anew, what it knows of the
  slot is checked against the store's metadata (``Slot.synced``) and replaced by it when
  another node wrote meanwhile (a stale resident copy is erased, never served); every write
  and delete carries the lease token as a fencing token, and a refused one drops this node's
  copy (:class:`orchestrator.slots.persistence.OwnershipLost`, logged and counted);
* with ``strict`` durability, a turn's answer waits until its state is stored
  (:meth:`SlotRegistry.commit_turn`); otherwise only the write-behind stores it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import structlog

from contract import protocol as proto
from contract.errors import ErrorCode
from orchestrator import metrics
from orchestrator.engine_client.interface import EngineClient
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import AdmissionQueue, WaitHooks
from orchestrator.slots.background import WriteBehind, every, stop
from orchestrator.slots.leases import LeaseKeeper
from orchestrator.slots.model import MAX_SLOT_ID, Slot, check_slot_id
from orchestrator.slots.persistence import OwnershipLost, SlotArchive
from orchestrator.slots.residency import Residency, uncancellable
from slotstate.ses1 import pack_ses1, unpack_ses1
from storage.base import SlotMeta

__all__ = ["MAX_SLOT_ID", "Slot", "SlotRegistry", "check_slot_id"]

log = structlog.get_logger("slotserve.slots")


class SlotRegistry(Residency):
    """Slots over one engine's ``n_seqs`` sequences (see module docstring).

    ``archive`` (None: nothing is stored, slots cannot be parked) and ``leases`` (None: one
    node) are the store's two faces; ``write_delay_s``: how long the write-behind waits to
    coalesce saves; ``park_idle_s``: park slots idle this long (None: never), looked for every
    ``upkeep_s`` seconds; ``strict``: a turn's answer waits for its state to be stored
    (``--durability strict``, docs/operations.md).
    """

    def __init__(
        self,
        engine: EngineClient,
        n_seqs: int,
        archive: SlotArchive | None = None,
        leases: LeaseKeeper | None = None,
        queue: AdmissionQueue[Slot] | None = None,
        *,
        write_delay_s: float = 0.2,
        park_idle_s: float | None = None,
        upkeep_s: float = 5.0,
        strict: bool = False,
    ) -> None:
        super().__init__(engine, n_seqs, queue, can_park=archive is not None)
        self.strict = strict and archive is not None
        self.archive = archive
        self.leases = leases
        self.slots: dict[str, Slot] = {}
        self.wait_s = 300.0  # longest wait for a busy slot (``--slot-wait``)
        self.park_idle_s = park_idle_s
        self.upkeep_s = upkeep_s
        self._dirty: set[str] = set()
        self.saver = WriteBehind(self.flush, lambda: bool(self._dirty), write_delay_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._last_purge = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Check the store and start the write-behind, the lease heartbeat and the upkeep."""
        if self.archive is None:
            return
        await self.archive.start()
        if self.leases is not None:
            self.leases.start()
        self._tasks = [
            asyncio.create_task(self.saver.run(), name="write-behind"),
            asyncio.create_task(every(self.upkeep_s, self.upkeep, "store maintenance"), name="store-maintenance"),
        ]

    async def shutdown(self) -> None:
        """Stop the tasks, save every dirty slot, release the leases, close the store."""
        await stop(self._tasks)
        if self.archive is None:
            return
        try:
            await self.flush(wait_for_locks=True)
        except ServiceError as exc:
            log.warning("could not save every slot at shutdown", error=exc.message)
        if self.leases is not None:
            await self.leases.stop()
        await self.archive.close()

    async def upkeep(self) -> None:
        """Park idle slots (``park_idle_s``) and, once a minute, purge expired stored states."""
        if self.park_idle_s:
            await self.park_idle(self.park_idle_s)
        if self.archive is not None and time.monotonic() - self._last_purge > 60:
            self._last_purge = time.monotonic()
            await self.archive.purge_expired()

    # ------------------------------------------------------------------ lookup

    @property
    def n_waiting(self) -> int:
        """Client requests waiting: for a slot another request holds, or for an engine sequence."""
        return sum(max(0, s.requests - 1) for s in self.slots.values()) + len(self.queue)

    def find(self, slot_id: str) -> Slot | None:
        """The slot or None."""
        return self.slots.get(slot_id)

    async def get(self, slot_id: str, create: bool) -> Slot:
        """The slot ``slot_id``; known to the store counts as existing.  ``SLOT_NOT_FOUND`` otherwise."""
        check_slot_id(slot_id)
        slot = self.slots.get(slot_id)
        if slot is None and self.archive is not None:
            meta = await self.archive.lookup(slot_id)
            if meta is not None:
                slot = self.slots.setdefault(slot_id, Slot(slot_id))
                self._take_meta(slot, meta)
        if slot is None:
            if not create:
                raise ServiceError(ErrorCode.SLOT_NOT_FOUND, f"slot {slot_id!r} does not exist")
            slot = self.slots[slot_id] = Slot(slot_id)
        return slot

    @asynccontextmanager
    async def use(
        self,
        slot_id: str,
        *,
        wait: bool = False,
        create: bool = True,
        resident: bool = True,
        hooks: WaitHooks | None = None,
    ) -> AsyncIterator[Slot]:
        """Hold ``slot_id`` exclusively (``SLOT_BUSY`` unless ``wait``), resident if asked.

        A slot that needs a sequence while all are busy waits in the admission queue
        (``hooks`` hears its position; see :meth:`ensure_resident`; a later
        :meth:`ensure_resident` of the holder uses the same ``hooks``).  When the request ends
        and others wait for a sequence, the slot is parked and its sequence handed on.
        A request that waits for a busy slot gets ``SLOT_BUSY`` after :attr:`wait_s` seconds,
        and ``CLIENT_GONE`` as soon as ``hooks.gone`` is set (its client left): it then
        leaves without having touched the slot.
        """
        slot = await self.get(slot_id, create)
        if slot.busy and not wait:
            raise ServiceError(ErrorCode.SLOT_BUSY, f"slot {slot_id!r} is processing another request", slot_id=slot_id)
        hooks = hooks or WaitHooks()
        slot.requests += 1  # a background save holding the lock is waited for, never reported as busy
        try:
            try:
                await asyncio.wait_for(hooks.unless_gone(slot.lock.acquire(), f"slot {slot_id!r}"), self.wait_s)
            except TimeoutError:
                raise ServiceError(
                    ErrorCode.SLOT_BUSY, f"slot {slot_id!r} stayed busy for {self.wait_s:g} s", slot_id=slot_id
                ) from None
            try:
                hooks.check(f"slot {slot_id!r}")
                slot.holder_hooks = hooks
                if self.leases is not None and await self.leases.claim(slot.id):
                    await self._sync(slot)
                if resident:
                    await self.ensure_resident(slot)
                    hooks.check("an engine sequence")
                try:
                    yield slot
                finally:
                    slot.last_used = time.monotonic()
                    if len(self.queue) and slot.requests == 1 and self.is_resident(slot):
                        # The client may leave right after its last event (a binary WebSocket
                        # closes after "done"): the hand-over finishes anyway, under the lock.
                        # Its request is over: the client's next one waits for the lock (and
                        # then queues), it is not told SLOT_BUSY.
                        slot.requests -= 1
                        try:
                            await uncancellable(self.hand_over(slot))
                        finally:
                            slot.requests += 1
            finally:
                slot.holder_hooks = None
                slot.lock.release()
        finally:
            slot.requests -= 1

    # ------------------------------------------------------------------ ownership

    @staticmethod
    def _version(meta: SlotMeta | None) -> tuple[int, str]:
        """The stored version ``meta`` describes, as ``Slot.synced`` records it."""
        return (meta.generation, meta.digest) if meta is not None else (0, "")

    def _take_meta(self, slot: Slot, meta: SlotMeta | None) -> None:
        """Know of ``slot`` what the store's ``meta`` says (None: nothing stored)."""
        slot.stored = meta is not None
        slot.n_tokens = meta.n_tokens if meta is not None else 0
        slot.stored_bytes = meta.stored_size if meta is not None else 0
        slot.raw_bytes = meta.raw_size if meta is not None else 0
        slot.synced = self._version(meta)

    async def _sync(self, slot: Slot) -> None:
        """The lease of ``slot`` (lock held) was just taken: unless the store still holds the
        version this node's copy comes from, drop the copy and take the store's metadata.  On
        failure the lease is given up again, so the next claim syncs anew."""
        assert self.archive is not None and self.leases is not None
        try:
            meta = await self.archive.lookup(slot.id)
        except BaseException:
            await self.leases.release(slot.id)
            raise
        seen = self._version(meta)
        if seen == slot.synced:
            return
        if slot.synced is not None or self.is_resident(slot):
            log.info("slot changed in the store since this node saw it", slot_id=slot.id, stored=seen)
        await self._drop_copy(slot)
        self._take_meta(slot, meta)

    async def _drop_copy(self, slot: Slot, grant: bool = True) -> None:
        """Forget this node's copy of ``slot`` (lock held): erase its cells, free its sequence
        (handed to the queue unless not ``grant``: the caller takes it); what it holds is then
        unknown (``synced`` None) until the store is asked."""
        if self.is_resident(slot):
            await self.engine.erase(slot.seq)  # type: ignore[arg-type]
        self._release_seq(slot)
        self._dirty.discard(slot.id)
        slot.dirty, slot.stored, slot.n_tokens, slot.synced = False, False, 0, None
        if grant:
            self._grant_free()

    async def _fence(self, slot: Slot) -> str | None:
        """The lease token that fences writes of ``slot`` (lock held; None without leases: one
        node).  A lease that lapsed while this node held the slot (a pause, a store outage
        longer than the lease) is taken back when no other node took it and the store still
        holds the version this node's copy comes from; else ``OwnershipLost`` (refused, counted).
        ``STORE_UNAVAILABLE`` when the store cannot be asked."""
        if self.leases is None:
            return None
        if not self.leases.holds(slot.id) and slot.synced is not None:
            assert self.archive is not None
            try:
                retaken = await self.leases.claim(slot.id)
            except ServiceError as exc:
                if exc.code != ErrorCode.SLOT_BUSY:
                    raise
                retaken = False  # another node holds it: refused below
            if retaken:
                try:
                    unchanged = self._version(await self.archive.lookup(slot.id)) == slot.synced
                except BaseException:
                    await self.leases.release(slot.id)
                    raise
                if not unchanged:
                    await self.leases.release(slot.id)
        return self.leases.token(slot.id)

    def _disown(self, slot: Slot) -> None:
        """A write of ``slot`` was refused: it is another node's now.  Its lease is forgotten and
        its copy marked unknown (the caller erases the cells under the slot's lock)."""
        if self.leases is not None:
            self.leases.forget(slot.id)
        self._dirty.discard(slot.id)
        slot.dirty, slot.synced = False, None

    # ------------------------------------------------------------------ residency (Residency's hooks)

    async def _fill(self, slot: Slot, seq: int, load: bool) -> None:
        if load and slot.stored and self.archive is not None:
            got = await self.archive.load(slot.id)
            if got is not None:
                meta, raw = got
                ses1 = unpack_ses1(raw)
                await self.engine.restore_state(seq, ses1.tokens, ses1.state)
                self._take_meta(slot, meta)
                slot.dirty = False
                metrics.RESTORES.inc()
                return
            slot.stored, slot.synced = False, (0, "")  # expired or deleted meanwhile: an empty slot
        await self.engine.erase(seq)
        if load:
            slot.n_tokens = 0

    async def park(self, slot: Slot) -> None:
        """Save ``slot`` (lock held) to the store, erase its cells, free its sequence and lease."""
        if slot.seq is None:
            return
        if self.archive is None:
            raise ServiceError(ErrorCode.RATE_LIMITED, "no store configured to park slots in")
        try:
            await self.ensure_saved(slot)
        except OwnershipLost:  # another node's now: its sequence is free all the same
            await uncancellable(self._drop_copy(slot, grant=False))
            return
        await uncancellable(self._drop(slot))
        log.info("slot parked", slot_id=slot.id, n_tokens=slot.n_tokens)

    async def _drop(self, slot: Slot) -> None:
        """Erase a saved slot's cells and free its sequence and lease (all or nothing)."""
        assert slot.seq is not None
        await self.engine.erase(slot.seq)
        self._release_seq(slot)
        if self.leases is not None:
            await self.leases.release(slot.id)

    def unload(self, slot: Slot) -> None:
        """Free the slot's sequence without saving (its stored copy, if any, stays the truth)."""
        self._release_seq(slot)
        slot.dirty = False
        self._grant_free()

    async def forget(self, slot: Slot) -> None:
        """Drop a slot entirely (lock held): engine cells and registry entry."""
        if self.is_resident(slot):
            await self.engine.erase(slot.seq)  # type: ignore[arg-type]
        self._release_seq(slot)
        self.slots.pop(slot.id, None)
        self._dirty.discard(slot.id)
        self._grant_free()

    async def delete(self, slot: Slot) -> bool:
        """Delete an idle slot entirely (takes its lock): its cells, its stored copy, its lease and
        its registry entry.  False, nothing done, when a request holds it or its stored copy cannot
        be deleted (``STORE_UNAVAILABLE``, another node's: logged)."""
        async with slot.lock:
            if slot.busy or self.slots.get(slot.id) is not slot:
                return False
            try:
                await self.erase(slot)
            except ServiceError as exc:
                log.warning("could not delete a slot", slot_id=slot.id, error=exc.message)
                return False
            await self.forget(slot)
            if self.leases is not None:
                await self.leases.release(slot.id)
        return True

    # ------------------------------------------------------------------ KV operations (lock held)

    async def tokens(self, slot: Slot) -> list[int]:
        """The slot's tokens: from the engine if resident (refreshing ``n_tokens``), else from the store."""
        if self.is_resident(slot):
            tokens = await self.engine.tokens(slot.seq)  # type: ignore[arg-type]
            slot.n_tokens = len(tokens)
            return tokens
        if slot.stored and self.archive is not None:
            meta = await self.archive.lookup(slot.id)
            return list(meta.tokens) if meta is not None else []
        return []

    async def peek_tokens(self, slot: Slot) -> list[int] | None:
        """A resident slot's tokens read from the engine without its lock (a snapshot, for choosing
        a slot: :mod:`orchestrator.slots.anonymous`); None when it is not resident."""
        if not self.is_resident(slot):
            return None
        return await self.engine.tokens(slot.seq)  # type: ignore[arg-type]

    async def state(self, slot: Slot) -> tuple[list[int], proto.Buffer] | None:
        """The slot's tokens and llama.cpp sequence state (``llama_state_seq_get_data``'s format):
        read from the engine if resident (the buffer it arrived in), else a view into the SES1
        blob decompressed from the store; None when it holds no state."""
        if self.is_resident(slot):
            saved = await self.engine.save_state(slot.seq)  # type: ignore[arg-type]
            return saved.tokens, saved.state
        if slot.stored and self.archive is not None:
            got = await self.archive.load(slot.id)
            if got is not None:
                ses1 = unpack_ses1(got[1])
                return list(ses1.tokens), ses1.state
        return None

    async def _read_state(self, slot: Slot) -> tuple[list[int], bytes]:
        saved = await self.engine.save_state(slot.seq)  # type: ignore[arg-type]
        try:
            ses1 = await asyncio.to_thread(pack_ses1, saved.tokens, saved.state)  # a copy of megabytes
        finally:
            self.engine.release_state(saved.state)  # copied into the blob: its receive buffer serves the next state
        return saved.tokens, ses1

    async def restore(self, slot: Slot, tokens: list[int], state: proto.Buffer, created: bool) -> None:
        """Replace the slot's KV state with ``tokens`` and their llama.cpp sequence ``state``.

        On any failure (the engine refuses the state: ``BAD_STATE``; no sequence:
        ``RATE_LIMITED``) the slot is as it was: dropped again if ``created`` (it did not
        exist before the request), back to parked (or empty) if it was not resident.
        """

        async def put(seq: int) -> int:
            await self.engine.restore_state(seq, tokens, state)
            return len(tokens)

        await self._replace(slot, created, put)

    async def restore_file(self, slot: Slot, path: Path, created: bool) -> proto.StateRestored:
        """Replace the slot with the slot file ``path``, read by the worker itself (it shares this
        file system: ``proto.LoadFile``); failures leave the slot as :meth:`restore` does."""
        done: list[proto.StateRestored] = []

        async def put(seq: int) -> int:
            done.append(await self.engine.load_file(seq, str(path)))
            return done[0].n_tokens

        await self._replace(slot, created, put)
        return done[0]

    async def _replace(self, slot: Slot, created: bool, put: Callable[[int], Awaitable[int]]) -> None:
        """Give the slot a sequence (not loading its stored state) and let ``put(seq)`` replace its
        cells (returning its new token count); the slot is as it was when anything fails (see
        :meth:`restore`)."""
        was_resident = self.is_resident(slot)
        try:
            seq = await self.ensure_resident(slot, load=False)
            n = await put(seq)
        except BaseException:
            if created:
                await self.forget(slot)
            elif not was_resident:
                self.unload(slot)
            raise
        slot.n_tokens = n
        slot.n_prompt_tokens_processed = 0
        self.schedule(slot)

    async def save_file(self, slot: Slot, path: Path) -> proto.FileSaved | None:
        """Write the resident slot to the slot file ``path`` from the worker (``proto.SaveFile``);
        ``None`` when the slot is not resident (its state is then in the store)."""
        if not self.is_resident(slot):
            return None
        return await self.engine.save_file(slot.seq, str(path))  # type: ignore[arg-type]

    async def context_shift(self, slot: Slot, n_keep: int, n_discard: int) -> int:
        """llama-server's context shift on the slot (restored first if parked); the new token count."""
        seq = await self.ensure_resident(slot)
        slot.n_tokens = len(await self.engine.context_shift(seq, n_keep, n_discard))
        self.schedule(slot)
        return slot.n_tokens

    async def erase(self, slot: Slot) -> None:
        """Drop the slot's cells and its stored state; it stays known, empty."""
        if self.is_resident(slot):
            await self.engine.erase(slot.seq)  # type: ignore[arg-type]
        if slot.stored and self.archive is not None:
            try:
                await self.archive.delete(slot.id, await self._fence(slot))
            except OwnershipLost:
                self._disown(slot)
                await self._drop_copy(slot)
                raise
        self._dirty.discard(slot.id)
        slot.stored, slot.dirty, slot.n_tokens = False, False, 0
        if self.archive is not None:
            slot.synced = (0, "")

    async def fork(self, src: Slot, dst: Slot) -> int:
        """Make ``dst`` a copy-on-write copy of ``src`` (shared cells); returns its token count.

        When no engine sequence is free for ``dst`` (every other slot busy), the copy is
        made in the store instead: ``dst`` starts parked with ``src``'s state.
        """
        try:
            # Holding two slots, a fork never queues for a sequence: the one it would wait for may
            # be the other slot's.  dst never evicts src: src's lock is held.
            src_seq = await self.ensure_resident(src, queue=False)
            dst_seq = await self.ensure_resident(dst, load=False, queue=False)
        except ServiceError as exc:
            if exc.code != ErrorCode.RATE_LIMITED or self.archive is None or self.is_resident(dst):
                raise
            got = await self.state(src)
            if got is None:
                raise ServiceError(ErrorCode.NO_CACHED_CONTEXT, f"slot {src.id!r} holds no state") from exc
            self.archive.check_up()
            dst.dirty = False
            try:
                ses1 = await asyncio.to_thread(pack_ses1, got[0], got[1])
            finally:
                self.engine.release_state(got[1])
            await self._write(dst, got[0], ses1, self.archive.next_version(), await self._fence(dst))
            return dst.n_tokens
        dst.n_tokens = len(await self.engine.fork(src_seq, dst_seq))
        self.schedule(dst)
        return dst.n_tokens

    # ------------------------------------------------------------------ generation reports

    def generation_started(self, slot: Slot, req: int, params: proto.SamplingParams) -> None:
        """A generation (engine request ``req``) starts on the slot: its cells are about to change."""
        slot.id_task, slot.params, slot.n_decoded = req, params, 0
        slot.dirty = True

    def generated(self, slot: Slot, n_tokens: int) -> None:
        """The slot now holds ``n_tokens`` tokens (a live count while it generates)."""
        slot.n_tokens = n_tokens

    def generation_done(self, slot: Slot, done: proto.Done) -> None:
        """The engine finished the slot's generation: take its counts (llama-server's ``/slots``)."""
        slot.n_tokens = done.seq_tokens
        slot.n_prompt_tokens_processed = done.n_prefilled
        slot.n_prompt_tokens_cache, slot.n_decoded = done.n_cached, done.n_generated

    def generation_ended(self, slot: Slot) -> None:
        """The slot's generation is over (done, cancelled or failed): save it (write-behind)
        unless :meth:`commit_turn` stored it already."""
        if slot.dirty:
            self.schedule(slot)

    async def commit_turn(self, slot: Slot) -> None:
        """With ``strict`` durability, store the slot's state (lock held) before its turn is
        answered: ``STORE_UNAVAILABLE`` or ``SLOT_BUSY`` (ownership lost) instead of an answer
        that a crash could lose.  Nothing to do otherwise."""
        if not self.strict:
            return
        t0 = time.perf_counter()
        try:
            await self.save(slot)
        except OwnershipLost:
            await self._drop_copy(slot)
            raise
        metrics.DURABLE_COMMIT_SECONDS.observe(time.perf_counter() - t0)

    # ------------------------------------------------------------------ saving

    def schedule(self, slot: Slot) -> None:
        """Mark ``slot`` changed and queue a save (coalesced with others for it)."""
        slot.dirty = True
        if self.archive is not None:
            self._dirty.add(slot.id)
            self.saver.wake()

    async def save(self, slot: Slot) -> SlotMeta | None:
        """Persist a resident slot (lock held by the caller) now; ``STORE_UNAVAILABLE`` if it
        cannot, ``SLOT_BUSY`` (:class:`OwnershipLost`: disowned, the caller drops the copy) if
        it is not ours."""
        assert self.archive is not None
        try:
            lease = await self._fence(slot)
        except OwnershipLost:
            self._disown(slot)
            raise
        version = self.archive.next_version()
        tokens, ses1 = await self._read_state(slot)
        slot.dirty = False  # from here; _write marks it dirty again if the write fails
        return await self._write(slot, tokens, ses1, version, lease)

    async def ensure_saved(self, slot: Slot) -> None:
        """Before ``slot`` (lock held) leaves the engine: wait for a write in flight, then save
        it if the store does not hold its current state (``STORE_UNAVAILABLE`` if it cannot)."""
        assert self.archive is not None
        await self.archive.settled(slot.id)  # a background write that fails marks the slot dirty again
        if slot.dirty or (slot.n_tokens and not slot.stored):
            await self.save(slot)

    async def _write(
        self, slot: Slot, tokens: list[int], ses1: bytes, version: int, lease: str | None
    ) -> SlotMeta | None:
        """Store a snapshot fenced by ``lease`` (unless a newer one is stored: None); on failure
        the slot is dirty again and queued for the write-behind; a refusal (``OwnershipLost``)
        disowns it."""
        assert self.archive is not None
        try:
            meta = await self.archive.write(slot.id, tokens, ses1, version, lease)
        except OwnershipLost:
            self._disown(slot)
            raise
        except BaseException:
            slot.dirty = True
            self._dirty.add(slot.id)
            raise
        if meta is not None:
            slot.stored, slot.synced = True, (meta.generation, meta.digest)
            slot.stored_bytes, slot.raw_bytes = meta.stored_size, meta.raw_size
            if not slot.dirty:
                slot.n_tokens = meta.n_tokens
        return meta

    async def flush(self, wait_for_locks: bool = False) -> int:
        """Save every dirty resident slot now (busy ones only with ``wait_for_locks``); how many were saved."""
        if self.archive is None:
            return 0
        saved = 0
        for slot_id in list(self._dirty):
            slot = self.slots.get(slot_id)
            if slot is None or not slot.dirty or not self.is_resident(slot):
                self._dirty.discard(slot_id)
                continue
            if (slot.lock.locked() or slot.busy) and not wait_for_locks:
                continue  # busy: its own end schedules it again
            async with slot.lock:  # held only to read the state: the write happens after
                if not (slot.dirty and self.is_resident(slot)):
                    self._dirty.discard(slot_id)
                    continue
                try:
                    lease = await self._fence(slot)
                except OwnershipLost:
                    self._disown(slot)
                    await self._drop_copy(slot)
                    continue
                version = self.archive.next_version()
                tokens, ses1 = await self._read_state(slot)
                slot.dirty = False
                self._dirty.discard(slot_id)
            try:
                if await self._write(slot, tokens, ses1, version, lease) is not None:
                    saved += 1
            except OwnershipLost:
                async with slot.lock:
                    if slot.synced is None:  # not taken back (and synced) meanwhile
                        await self._drop_copy(slot)
        return saved
