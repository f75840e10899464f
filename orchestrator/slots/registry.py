"""The slot registry: the one owner of slots, composed of one member per responsibility.

A slot is a conversation's KV state, addressed by a string id per tenant (``"0"`` is the default
slot, numeric ids work like llama-server's; two tenants may both name ``chat1``).  It is
*resident* while it holds an engine sequence and *parked* when only the store has it.
:class:`SlotRegistry` does lookup and use itself and holds the rest as members (as vLLM's
scheduler holds its KV cache manager), each testable alone:

* :attr:`SlotRegistry.residency` (:class:`orchestrator.slots.residency.Residency`): which slot
  holds which engine sequence, the admission queue, least-recently-used parking;
* :attr:`SlotRegistry.ownership` (:class:`orchestrator.slots.ownership.Ownership`): leases, store
  sync, fencing tokens, disowning a slot another node took;
* :attr:`SlotRegistry.durability` (:class:`orchestrator.slots.durability.Durability`, None
  without a store): the write-behind, the strict commit of a turn, flushing;
* :attr:`SlotRegistry.kv` (:class:`orchestrator.slots.sequences.SequenceOps`): the KV operations
  and state I/O on a held slot;
* :attr:`SlotRegistry.conversations` (:class:`orchestrator.slots.conversations.StoredConversations`):
  the Responses API's stored conversations, in the store beside the slots.

These modules are the only writers of :class:`orchestrator.slots.model.Slot` fields and the only
callers of KV operations on the engine; generation and the slot actions report back through the
registry's methods.  The registry serializes use of a slot: one generation or slot action at a
time (``SLOT_BUSY``, HTTP 409, unless the request asks to wait; a wait is bounded by ``wait_s``
seconds, then ``SLOT_BUSY`` too), holds the slot's lease while it is resident, notices a restarted
worker (sequences gone) and parks idle slots after ``--park-idle`` seconds.  A tenant sees only
its own slots: another tenant's slot is missing to it (``SLOT_NOT_FOUND``), decided by the key
alone (:func:`orchestrator.slots.model.slot_key`), never by a comparison of timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.options import SamplingParams
from orchestrator import metrics
from orchestrator.engine_client.interface import EngineClient
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import AdmissionQueue, WaitHooks
from orchestrator.slots.background import every, stop
from orchestrator.slots.conversations import StoredConversations
from orchestrator.slots.durability import Durability
from orchestrator.slots.leases import LeaseKeeper
from orchestrator.slots.model import MAX_SLOT_ID, Slot, check_slot_id, slot_key
from orchestrator.slots.ownership import Ownership, take_meta
from orchestrator.slots.persistence import OwnershipLost, SlotArchive
from orchestrator.slots.residency import Residency, uncancellable
from orchestrator.slots.sequences import SequenceOps
from orchestrator.tenants.principal import DEFAULT_TENANT
from slotstate.ses1 import unpack_ses1

CHUNK_GRACE_S = 600.0
"""How long a KV chunk no stored slot names is kept after it was last written or found: far longer than
a save takes from finding its chunks to committing the metadata that names them."""

__all__ = ["MAX_SLOT_ID", "Slot", "SlotRegistry", "check_slot_id"]

log = structlog.get_logger("slotserve.slots")


class SlotRegistry:
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
        self.engine = engine
        self.archive = archive
        self.leases = leases
        self.slots: dict[str, Slot] = {}  # by Slot.key (tenant/id)
        self.wait_s = 300.0  # longest wait for a busy slot (``--slot-wait``)
        self.park_idle_s = park_idle_s
        self.upkeep_s = upkeep_s
        self.residency = Residency(engine, n_seqs, queue, self if archive is not None else None)
        self.ownership = Ownership(archive, leases, self.residency)
        self.durability: Durability | None = None
        if archive is not None:
            self.durability = Durability(
                engine,
                archive,
                self.residency,
                self.ownership,
                self.slots.get,
                strict=strict,
                write_delay_s=write_delay_s,
            )
        self.kv = SequenceOps(engine, self.residency, self.ownership, self.durability, self.forget)
        self.conversations = StoredConversations(archive)  # the Responses API's, beside the slots
        self._tasks: list[asyncio.Task[None]] = []
        self._last_purge = 0.0

    # ------------------------------------------------------------------ what the members know

    @property
    def strict(self) -> bool:
        """A turn is answered once its state is stored (``--durability strict`` with a store)."""
        return self.durability is not None and self.durability.strict

    @property
    def queue(self) -> AdmissionQueue[Slot]:
        """Requests waiting for an engine sequence."""
        return self.residency.queue

    @property
    def n_seqs(self) -> int:
        """Engine sequences slots may hold."""
        return self.residency.n_seqs

    def is_resident(self, slot: Slot) -> bool:
        """True if the slot's sequence belongs to the running worker."""
        return self.residency.is_resident(slot)

    async def ensure_resident(self, slot: Slot) -> int:
        """Give ``slot`` (lock held) an engine sequence, restored if parked
        (:meth:`orchestrator.slots.residency.Residency.ensure_resident`)."""
        return await self.residency.ensure_resident(slot)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Check the store and start the write-behind, the lease heartbeat and the upkeep."""
        if self.archive is None or self.durability is None:
            return
        await self.archive.start()
        if self.leases is not None:
            self.leases.start()
        self._tasks = [
            asyncio.create_task(self.durability.saver.run(), name="write-behind"),
            asyncio.create_task(every(self.upkeep_s, self.upkeep, "store maintenance"), name="store-maintenance"),
        ]

    async def shutdown(self) -> None:
        """Stop the tasks, save every dirty slot, release the leases, close the store."""
        await stop(self._tasks)
        if self.archive is None or self.durability is None:
            return
        try:
            await self.durability.flush(wait_for_locks=True)
        except ServiceError as exc:
            log.warning("could not save every slot at shutdown", error=exc.message)
        if self.leases is not None:
            await self.leases.stop()
        await self.archive.close()

    async def upkeep(self) -> None:
        """Park idle slots (``park_idle_s``, or a slot's own :meth:`keep_alive`) and, once a minute, purge
        expired stored states and sweep the KV chunks no stored slot names (untouched for
        :data:`CHUNK_GRACE_S`)."""
        if self.park_idle_s or any(s is not None and s.keep_alive_s is not None for s in self.residency.owner):
            await self.residency.park_idle(self.park_idle_s or None)
        if self.archive is not None and time.monotonic() - self._last_purge > 60:
            self._last_purge = time.monotonic()
            await self.archive.purge_expired()
            with contextlib.suppress(ServiceError):
                await self.archive.sweep_chunks(CHUNK_GRACE_S)

    # ------------------------------------------------------------------ lookup

    @property
    def n_waiting(self) -> int:
        """Client requests waiting: for a slot another request holds, or for an engine sequence."""
        return sum(max(0, s.requests - 1) for s in self.slots.values()) + len(self.queue)

    def waiting_of(self, tenant: str) -> int:
        """:attr:`n_waiting` of ``tenant``'s requests alone."""
        return sum(max(0, s.requests - 1) for s in self.of_tenant(tenant)) + self.queue.waiting(tenant)

    def find(self, slot_id: str, tenant: str = DEFAULT_TENANT) -> Slot | None:
        """``tenant``'s slot ``slot_id`` known on this node, or None."""
        return self.slots.get(slot_key(tenant, slot_id))

    def of_tenant(self, tenant: str | None) -> list[Slot]:
        """The slots known on this node of ``tenant`` (None: every tenant's, for an admin)."""
        return [s for s in self.slots.values() if tenant is None or s.tenant == tenant]

    async def exists(self, slot_id: str, tenant: str = DEFAULT_TENANT) -> bool:
        """Whether ``tenant`` has a slot ``slot_id`` here or in the store (``STORE_UNAVAILABLE``)."""
        if self.find(slot_id, tenant) is not None:
            return True
        return self.archive is not None and await self.archive.lookup(slot_key(tenant, slot_id)) is not None

    async def get(self, slot_id: str, create: bool, tenant: str = DEFAULT_TENANT, partition: str = "") -> Slot:
        """``tenant``'s slot ``slot_id``; known to the store counts as existing.  ``SLOT_NOT_FOUND``
        otherwise: another tenant's slot of that id answers exactly so.  A slot made here (``create``)
        is in the cache ``partition``."""
        check_slot_id(slot_id)
        key = slot_key(tenant, slot_id)
        slot = self.slots.get(key)
        if slot is None and self.archive is not None:
            meta = await self.archive.lookup(key)
            if meta is not None:
                slot = self.slots.setdefault(key, Slot(slot_id, tenant))
                take_meta(slot, meta)
        if slot is None:
            if not create:
                raise ServiceError(ErrorCode.SLOT_NOT_FOUND, f"slot {slot_id!r} does not exist")
            slot = self.slots[key] = Slot(slot_id, tenant, partition)
        return slot

    @asynccontextmanager
    async def use(
        self,
        slot_id: str,
        *,
        tenant: str = DEFAULT_TENANT,
        partition: str = "",
        wait: bool = False,
        create: bool = True,
        resident: bool = True,
        hooks: WaitHooks | None = None,
    ) -> AsyncIterator[Slot]:
        """Hold ``tenant``'s slot ``slot_id`` exclusively (``SLOT_BUSY`` unless ``wait``), resident if asked
        (made in the cache ``partition`` when ``create`` makes it).

        A slot that needs a sequence while all are busy waits in the admission queue
        (``hooks`` hears its position; a later ensure_resident of the holder uses the same
        ``hooks``).  When the request ends and others wait for a sequence, the slot is parked
        and its sequence handed on.  A request that waits for a busy slot gets ``SLOT_BUSY``
        after :attr:`wait_s` seconds, and ``CLIENT_GONE`` as soon as ``hooks.gone`` is set (its
        client left): it then leaves without having touched the slot.
        """
        slot = await self.get(slot_id, create, tenant, partition)
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
                await self.ownership.claim(slot)
                if resident:
                    await self.residency.ensure_resident(slot)
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
                            await uncancellable(self.residency.hand_over(slot))
                        finally:
                            slot.requests += 1
            finally:
                slot.holder_hooks = None
                slot.lock.release()
        finally:
            slot.requests -= 1

    # ------------------------------------------------------------------ parking (Residency's Parking)

    async def fill(self, slot: Slot, seq: int, load: bool) -> None:
        """Put ``slot``'s stored state (``load``) or nothing into the fresh sequence ``seq``."""
        if load and slot.stored and self.archive is not None:
            try:
                got = await self.archive.load(slot.key)
            except ServiceError as exc:
                if exc.code == ErrorCode.BAD_STATE:
                    # refused (a damaged state, a KV chunk lost): answered BAD_STATE now; the slot's next
                    # request starts from no state (a re-prefill) and its save replaces the stored one
                    slot.stored = False
                raise
            if got is not None:
                meta, raw = got
                ses1 = unpack_ses1(raw)
                await self.engine.restore_state(seq, ses1.tokens, ses1.state)
                take_meta(slot, meta)
                if self.durability is not None:
                    self.durability.increments.restored(slot, meta)
                slot.dirty = False
                metrics.RESTORES.labels(slot.tenant).inc()
                return
            slot.stored, slot.synced = False, (0, "")  # expired or deleted meanwhile: an empty slot
        await self.engine.erase(seq)
        if load:
            slot.n_tokens = 0

    async def park(self, slot: Slot) -> None:
        """Save ``slot`` (lock held) to the store, erase its cells, free its sequence and lease."""
        if slot.seq is None:
            return
        if self.durability is None:
            raise ServiceError(ErrorCode.RATE_LIMITED, "no store configured to park slots in")
        try:
            await self.durability.ensure_saved(slot)
        except OwnershipLost:  # another node's now: its sequence is free all the same
            await uncancellable(self.ownership.drop_copy(slot, grant=False))
            return
        await uncancellable(self._drop(slot))
        log.info("slot parked", slot_id=slot.id, tenant=slot.tenant, n_tokens=slot.n_tokens)

    async def _drop(self, slot: Slot) -> None:
        """Erase a saved slot's cells and free its sequence and lease (all or nothing)."""
        await self.residency.vacate(slot, grant=False)
        await self.ownership.release(slot)

    async def forget(self, slot: Slot) -> None:
        """Drop a slot entirely (lock held): engine cells and registry entry."""
        await self.residency.vacate(slot)
        self.slots.pop(slot.key, None)
        if self.durability is not None:
            self.durability.pending.discard(slot.key)

    async def delete(self, slot: Slot) -> bool:
        """Delete an idle slot entirely (takes its lock): its cells, its stored copy, its lease and
        its registry entry.  False, nothing done, when a request holds it or its stored copy cannot
        be deleted (``STORE_UNAVAILABLE``, another node's: logged)."""
        async with slot.lock:
            if slot.busy or self.slots.get(slot.key) is not slot:
                return False
            try:
                await self.kv.erase(slot)
            except ServiceError as exc:
                log.warning("could not delete a slot", slot_id=slot.id, error=exc.message)
                return False
            await self.forget(slot)
            await self.ownership.release(slot)
        return True

    async def enter_partition(self, slot: Slot, partition: str) -> None:
        """A request of cache ``partition`` takes the held ``slot`` it named: a cache of another
        partition is never reused, so the slot is erased (cells and stored copy) and moves over."""
        if slot.partition == partition:
            return
        await self.kv.erase(slot)
        slot.partition = partition

    # ------------------------------------------------------------------ generation reports

    def keep_alive(self, slot: Slot, seconds: float | None) -> None:
        """Park ``slot`` once it has been idle ``seconds`` (Ollama's ``keep_alive``; ``inf``: never for being
        idle, None: after ``park_idle_s`` as every slot), looked at by :meth:`upkeep`."""
        slot.keep_alive_s = seconds

    def generation_started(self, slot: Slot, req: int, params: SamplingParams) -> None:
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
            self.kv.changed(slot)

    async def commit_turn(self, slot: Slot) -> None:
        """With ``strict`` durability, store the slot's state (lock held) before its turn is
        answered (:meth:`orchestrator.slots.durability.Durability.commit_turn`)."""
        if self.durability is not None:
            await self.durability.commit_turn(slot)
