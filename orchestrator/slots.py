"""The slot registry: conversations (slots) and the engine sequences they occupy.

A slot is a conversation's KV state, addressed by a string id (``"0"`` is the
default slot, numeric ids work like llama-server's).  It is *resident* while it holds
an engine sequence and *parked* when only the store has it.  The registry:

* serializes use of a slot: one generation or admin operation at a time
  (``SLOT_BUSY``, HTTP 409, unless the request asks to wait; a wait is bounded by
  ``wait_s`` seconds, then ``SLOT_BUSY`` too);
* gives a slot a sequence on demand, parking the least recently used idle slot when
  all ``--parallel`` sequences are taken, and restoring a parked slot transparently;
* when every sequence serves a request, queues the newcomer in a bounded FIFO
  (:class:`orchestrator.admission.AdmissionQueue`): the next request to finish parks its
  slot and hands its sequence to the head of the queue, so equal clients take turns;
* notices a restarted worker (sequences gone) and reloads slots from the store.

Persistence itself (SES1 + codec + store, write-behind, leases) is
:class:`orchestrator.persistence.Persistence`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from engine import protocol as proto
from orchestrator import metrics
from orchestrator.admission import AdmissionQueue, Ticket, WaitHooks
from orchestrator.engine_api import EngineClient
from orchestrator.errors import ApiError

if TYPE_CHECKING:
    from orchestrator.persistence import Persistence

log = structlog.get_logger("slotserve.slots")

MAX_SLOT_ID = 256


@dataclass(eq=False)
class Slot:
    """One conversation's state and bookkeeping."""

    id: str
    seq: int | None = None
    n_tokens: int = 0
    engine_generation: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stored: bool = False
    dirty: bool = False
    stored_bytes: int = 0
    raw_bytes: int = 0
    n_prompt_tokens_processed: int = 0
    # the last generation on this slot, for llama-server's GET /slots (id_task, params, next_token)
    id_task: int = -1
    params: proto.SamplingParams | None = None
    n_decoded: int = 0
    n_prompt_tokens_cache: int = 0
    requests: int = 0  # client requests holding or waiting for the lock (not background saves)

    @property
    def busy(self) -> bool:
        """True while a client request uses the slot (``is_processing``)."""
        return self.requests > 0

    @property
    def place(self) -> str:
        """``resident`` (holds an engine sequence), ``parked`` (store only) or ``empty``."""
        if self.seq is not None:
            return "resident"
        return "parked" if self.stored else "empty"


async def _uncancellable(step: Coroutine[Any, Any, None]) -> None:
    """Run ``step`` to its end even if the caller is cancelled meanwhile (the cancellation is
    re-raised after it), so a slot is never left half parked."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


def check_slot_id(slot_id: str) -> str:
    """Validate a slot id (1..256 printable characters); raise ``INVALID_REQUEST``."""
    if not slot_id or len(slot_id) > MAX_SLOT_ID or not slot_id.isprintable():
        raise ApiError("INVALID_REQUEST", f"bad slot id {slot_id[:40]!r}: 1..{MAX_SLOT_ID} printable characters")
    return slot_id


class SlotRegistry:
    """Slots and sequence assignment over one :class:`EngineClient` (see module docstring)."""

    def __init__(
        self,
        engine: EngineClient,
        n_seqs: int,
        persistence: Persistence | None = None,
        queue: AdmissionQueue[Slot] | None = None,
    ) -> None:
        self.engine = engine
        self.n_seqs = n_seqs
        self.persistence = persistence
        self.queue: AdmissionQueue[Slot] = queue if queue is not None else AdmissionQueue()
        self.slots: dict[str, Slot] = {}
        self.owner: list[Slot | None] = [None] * n_seqs
        self._alloc = asyncio.Lock()
        self.wait_s = 300.0  # longest wait for a busy slot (``--slot-wait``)

    # ------------------------------------------------------------------ lookup

    def find(self, slot_id: str) -> Slot | None:
        """The slot or None."""
        return self.slots.get(slot_id)

    async def get(self, slot_id: str, create: bool) -> Slot:
        """The slot ``slot_id``; known to the store counts as existing.  ``SLOT_NOT_FOUND`` otherwise."""
        check_slot_id(slot_id)
        slot = self.slots.get(slot_id)
        if slot is None and self.persistence is not None:
            meta = await self.persistence.lookup(slot_id)
            if meta is not None:
                slot = self.slots.setdefault(slot_id, Slot(slot_id))
                slot.stored, slot.n_tokens = True, meta.n_tokens
                slot.stored_bytes, slot.raw_bytes = meta.stored_size, meta.raw_size
        if slot is None:
            if not create:
                raise ApiError("SLOT_NOT_FOUND", f"slot {slot_id!r} does not exist")
            slot = self.slots[slot_id] = Slot(slot_id)
        return slot

    # ------------------------------------------------------------------ use

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
        (``hooks`` hears its position; see :meth:`ensure_resident`).  When the request ends
        and others wait for a sequence, the slot is parked and its sequence handed on.
        A request that waits for a busy slot gets ``SLOT_BUSY`` after :attr:`wait_s` seconds.
        """
        slot = await self.get(slot_id, create)
        if slot.busy and not wait:
            raise ApiError("SLOT_BUSY", f"slot {slot_id!r} is processing another request", slot_id=slot_id)
        slot.requests += 1  # a background save holding the lock is waited for, never reported as busy
        try:
            try:
                await asyncio.wait_for(slot.lock.acquire(), self.wait_s)
            except TimeoutError:
                raise ApiError(
                    "SLOT_BUSY", f"slot {slot_id!r} stayed busy for {self.wait_s:g} s", slot_id=slot_id
                ) from None
            try:
                if self.persistence is not None:
                    await self.persistence.claim(slot)
                if resident:
                    await self.ensure_resident(slot, hooks=hooks)
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
                            await _uncancellable(self._hand_over(slot))
                        finally:
                            slot.requests += 1
            finally:
                slot.lock.release()
        finally:
            slot.requests -= 1

    def is_resident(self, slot: Slot) -> bool:
        """True if the slot's sequence belongs to the running worker."""
        return slot.seq is not None and slot.engine_generation == self.engine.generation

    async def ensure_resident(
        self, slot: Slot, load: bool = True, hooks: WaitHooks | None = None, queue: bool = True
    ) -> int:
        """Give ``slot`` (whose lock the caller holds) an engine sequence; restore it if parked.

        With ``load=False`` a parked slot gets an empty sequence (the caller replaces its
        state; :meth:`unload` undoes this if that fails).  When every sequence serves a
        request, waits its turn in :attr:`queue`; ``RATE_LIMITED`` (with ``retry_after``)
        when the queue is full or the wait exceeds ``--queue-timeout``, ``CLIENT_GONE``
        when ``hooks.gone`` is set meanwhile.  ``queue=False``: ``RATE_LIMITED`` at once
        instead of waiting (for a caller that holds another slot's sequence: waiting could
        wait for itself).
        """
        if self.is_resident(slot):
            return slot.seq  # type: ignore[return-value]
        if slot.seq is not None:  # the worker restarted: the old sequence is gone
            self._release_seq(slot)
        async with self._alloc:
            seq = None
            if not len(self.queue):  # nobody is ahead: take a free sequence or park an idle slot
                seq = self._free_seq()
                if seq is None and self._idle_residents():
                    seq = await self._evict_if_idle()
            if seq is not None:
                self._assign(slot, seq)
            elif self.persistence is None or not self.queue.max_waiting or not queue:
                raise self.queue.refusal(
                    f"all {self.n_seqs} engine sequences are busy"
                    + ("" if self.persistence is not None else " (and there is no store to park slots in)")
                )
            else:
                ticket = self.queue.enter(slot)
        if seq is None:
            seq = await self._wait_turn(ticket, hooks)
        try:
            if load and slot.stored and self.persistence is not None:
                await self.persistence.load_into(slot, seq)
            else:
                await self.engine.erase(seq)
                if load:
                    slot.n_tokens = 0
        except BaseException:
            self._release_seq(slot)
            self._grant_free()
            raise
        return seq

    def _assign(self, slot: Slot, seq: int) -> None:
        self.owner[seq] = slot
        slot.seq, slot.engine_generation = seq, self.engine.generation

    def _idle_residents(self) -> list[Slot]:
        return [s for s in self.owner if s is not None and not s.busy]

    async def _wait_turn(self, ticket: Ticket[Slot], hooks: WaitHooks | None) -> int:
        """Wait in the queue until granted a sequence (then ``ticket.slot`` owns it)."""
        slot = ticket.slot
        t0 = time.monotonic()
        deadline = t0 + self.queue.max_wait_s
        shown = 0
        try:
            while True:
                if hooks is not None and hooks.gone.is_set():
                    raise ApiError("CLIENT_GONE", "the client left while its request was queued")
                pos = ticket.position
                if hooks is not None and hooks.on_position is not None and pos and pos != shown:
                    shown = pos
                    await hooks.on_position(pos)
                left = deadline - time.monotonic()
                if left <= 0:
                    metrics.QUEUE_REFUSED.labels("timeout").inc()
                    raise self.queue.refusal(f"no engine sequence came free within {self.queue.max_wait_s:g} s")
                seq = await ticket.wait(min(left, 0.5), hooks.gone if hooks is not None else None)
                if seq is not None:
                    metrics.QUEUE_WAIT_SECONDS.observe(time.monotonic() - t0)
                    return seq
                if ticket.position == 1 and self._idle_residents():
                    await self._serve_head()  # an idle slot appeared without handing over (e.g. a failed park)
        except BaseException:
            if ticket.outcome.done() and not ticket.outcome.exception() and slot.seq is not None:
                self._release_seq(slot)  # granted, but the waiter is gone: pass the sequence on
                self._grant_free()
            raise
        finally:
            self.queue.leave(ticket)

    def _grant_free(self) -> None:
        """Give free sequences to the queue's head tickets, in order."""
        while len(self.queue) and (seq := self._free_seq()) is not None:
            ticket = self.queue.pop()
            assert ticket is not None
            self._assign(ticket.slot, seq)
            ticket.grant(seq)

    async def _serve_head(self) -> None:
        """Park the least recently used idle slot for the queue's head (under the allocation lock)."""
        async with self._alloc:
            if not len(self.queue):
                return
            try:
                await self._evict_if_idle()
            except ApiError as exc:  # the store is down: nobody gets a sequence until it is back
                self.queue.fail_all(exc)
                return
            self._grant_free()

    async def _evict_if_idle(self) -> int | None:
        """:meth:`_evict`, or None when every sequence serves a request (raises a store failure)."""
        try:
            return await self._evict()
        except ApiError as exc:
            if exc.code != "RATE_LIMITED" or self.persistence is None:
                raise
            return None

    async def _hand_over(self, slot: Slot) -> None:
        """Park ``slot`` (its last request just ended; lock held) for the requests queued for a sequence."""
        try:
            await self.park(slot)
        except ApiError as exc:  # the store cannot take it: nobody gets a sequence until it can
            log.warning("could not park a slot for a queued request", slot_id=slot.id, error=exc.message)
            if exc.code == "STORE_UNAVAILABLE":
                self.queue.fail_all(exc)
            return
        self._grant_free()

    def _free_seq(self) -> int | None:
        gen = self.engine.generation
        for i, s in enumerate(self.owner):
            if s is None or s.engine_generation != gen or s.seq != i:
                if s is not None and s.seq == i:
                    s.seq = None
                self.owner[i] = None
                return i
        return None

    def _release_seq(self, slot: Slot) -> None:
        if slot.seq is not None and 0 <= slot.seq < self.n_seqs and self.owner[slot.seq] is slot:
            self.owner[slot.seq] = None
        slot.seq = None

    def unload(self, slot: Slot) -> None:
        """Free the slot's sequence without saving (its stored copy, if any, stays the truth)."""
        self._release_seq(slot)
        slot.dirty = False
        self._grant_free()

    async def _evict(self) -> int:
        """Park the least recently used idle resident slot and return its sequence.

        Idle means no client request uses it; one that a background save holds right now
        is waited for (unlocked ones first).  ``RATE_LIMITED`` when every sequence serves
        a client request.
        """
        while True:
            idle = [s for s in self.owner if s is not None and not s.busy]
            if not idle:
                raise ApiError("RATE_LIMITED", f"all {self.n_seqs} engine sequences are busy")
            victim = min(idle, key=lambda s: (s.lock.locked(), s.last_used))
            async with victim.lock:
                seq = victim.seq
                if victim.busy or seq is None or self.owner[seq] is not victim:
                    free = self._free_seq()  # parked meanwhile, or taken by a request: look again
                    if free is not None:
                        return free
                    continue
                await self.park(victim)
                return seq

    async def park(self, slot: Slot) -> None:
        """Save ``slot`` (lock held) to the store and free its sequence."""
        if slot.seq is None:
            return
        if self.persistence is None:
            raise ApiError("RATE_LIMITED", "no store configured to park slots in")
        await self.persistence.ensure_saved(slot)
        await _uncancellable(self._drop(slot))
        log.info("slot parked", slot_id=slot.id, n_tokens=slot.n_tokens)

    async def _drop(self, slot: Slot) -> None:
        """Erase a saved slot's cells and free its sequence and lease (all or nothing)."""
        assert slot.seq is not None and self.persistence is not None
        await self.engine.erase(slot.seq)
        self._release_seq(slot)
        await self.persistence.release(slot)

    async def park_idle(self, idle_s: float) -> int:
        """Park every resident slot idle for more than ``idle_s`` seconds (frees its sequence
        and its lease, so another node may take the conversation).  Returns how many."""
        now = time.monotonic()
        parked = 0
        for slot in [s for s in self.owner if s is not None]:
            if slot.busy or slot.lock.locked() or now - slot.last_used < idle_s or not self.is_resident(slot):
                continue
            async with slot.lock:
                if not slot.busy and self.is_resident(slot):
                    await self.park(slot)
                    parked += 1
        self._grant_free()
        return parked

    async def forget(self, slot: Slot) -> None:
        """Drop a slot entirely (lock held): engine cells and registry entry."""
        if self.is_resident(slot):
            await self.engine.erase(slot.seq)  # type: ignore[arg-type]
        self._release_seq(slot)
        self.slots.pop(slot.id, None)
        self._grant_free()

    def on_engine_restart(self) -> None:
        """The worker restarted: every resident slot lost its cells (stored ones reload on use)."""
        for i, s in enumerate(self.owner):
            if s is not None:
                s.seq = None
                if not s.stored:
                    s.n_tokens = 0
            self.owner[i] = None
        self._grant_free()
