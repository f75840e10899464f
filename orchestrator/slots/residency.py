"""Which slot holds which engine sequence: assignment, fair waiting, least-recently-used parking.

The engine has ``--parallel`` sequences and there may be more conversations.  A slot
that needs a sequence takes a free one, else the least recently used idle slot is
parked (:meth:`Residency.park`, saved to the store and erased) and its sequence taken;
of several free sequences the one freed last is taken (:meth:`Residency._free_seq`), whose KV
stream the worker still holds in memory for a few seconds (``engine/kv_release.py``); when every
sequence serves a request, the newcomer waits in a bounded FIFO
(:class:`orchestrator.slots.admission.AdmissionQueue`): the next request to finish parks its
slot and hands its sequence to the head of the queue, so equal clients take turns.

:class:`Residency` is a member of :class:`orchestrator.slots.registry.SlotRegistry`; it knows no
store: the registry hands it how to park a slot and how to fill a fresh sequence
(:class:`Parking`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import structlog

from contract.errors import ErrorCode
from orchestrator import metrics
from orchestrator.engine_client.interface import EngineClient
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import AdmissionQueue, Ticket, WaitHooks
from orchestrator.slots.model import Slot
from orchestrator.tenants.limits import TenantLimits

log = structlog.get_logger("slotserve.slots")


async def uncancellable(step: Coroutine[Any, Any, None]) -> None:
    """Run ``step`` to its end even if the caller is cancelled meanwhile (the cancellation is
    re-raised after it), so a slot is never left half parked."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


class Parking(Protocol):
    """What :class:`Residency` asks of its owner (the registry)."""

    async def park(self, slot: Slot) -> None:
        """Save ``slot`` (lock held) and free its sequence."""

    async def fill(self, slot: Slot, seq: int, load: bool) -> None:
        """Put ``slot``'s stored state (``load``) or nothing into the fresh sequence ``seq``."""


class Residency:
    """Sequence assignment over ``n_seqs`` engine sequences (see module docstring).

    ``parking``: how slots are parked and filled (None: they cannot be parked, no store is
    configured, and a request that finds no free sequence gets ``RATE_LIMITED`` at once; a
    fresh sequence is only erased).
    """

    def __init__(
        self, engine: EngineClient, n_seqs: int, queue: AdmissionQueue[Slot] | None, parking: Parking | None
    ) -> None:
        self.engine = engine
        self.n_seqs = n_seqs
        self.parking = parking
        self.can_park = parking is not None
        self.queue: AdmissionQueue[Slot] = queue if queue is not None else AdmissionQueue(0, 0.0)  # none: 429 at once
        self.owner: list[Slot | None] = [None] * n_seqs
        self._freed_at: list[int] = [0] * n_seqs  # when each sequence was last freed (0: never held)
        self._clock = itertools.count(1)
        self._alloc = asyncio.Lock()
        self.limits: TenantLimits | None = None  # --tenant-resident (orchestrator/tenants/limits.py)

    async def park(self, slot: Slot) -> None:
        """Save ``slot`` (lock held) and free its sequence (``RATE_LIMITED`` with no store to park in)."""
        if self.parking is None:
            raise ServiceError(ErrorCode.RATE_LIMITED, "no store configured to park slots in")
        await self.parking.park(slot)

    async def _fill(self, slot: Slot, seq: int, load: bool) -> None:
        if self.parking is not None:
            await self.parking.fill(slot, seq, load)
            return
        await self.engine.erase(seq)
        if load:
            slot.n_tokens = 0

    async def vacate(self, slot: Slot, grant: bool = True) -> None:
        """Erase ``slot``'s cells (lock held) and free its sequence, handed to the queue unless not
        ``grant`` (the caller takes it)."""
        if self.is_resident(slot):
            await self.engine.erase(slot.seq)  # type: ignore[arg-type]
        self.release_seq(slot)
        if grant:
            self.grant_free()

    def unload(self, slot: Slot) -> None:
        """Free the slot's sequence without saving (its stored copy, if any, stays the truth)."""
        self.release_seq(slot)
        slot.dirty = False
        self.grant_free()

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
        wait for itself).  ``hooks`` defaults to those of the request holding the slot.
        """
        hooks = hooks or slot.holder_hooks
        if self.is_resident(slot):
            return slot.seq  # type: ignore[return-value]
        if slot.seq is not None:  # the worker restarted: the old sequence is gone
            self.release_seq(slot)
        if self.limits is not None and self.limits.resident:
            await self._within_tenant_limit(slot)
        async with self._alloc:
            seq = None
            if not len(self.queue):  # nobody is ahead: take a free sequence or park an idle slot
                seq = self._free_seq()
                if seq is None and self._idle_residents():
                    seq = await self._evict_if_idle()
            if seq is not None:
                self._assign(slot, seq)
            elif not self.can_park or not self.queue.max_waiting or not queue:
                raise self.queue.refusal(
                    f"all {self.n_seqs} engine sequences are busy"
                    + ("" if self.can_park else " (and there is no store to park slots in)")
                )
            else:
                ticket = self.queue.enter(slot)
        if seq is None:
            seq = await self._wait_turn(ticket, hooks)
        try:
            await self._fill(slot, seq, load)
        except BaseException:
            self.release_seq(slot)
            self.grant_free()
            raise
        return seq

    async def _within_tenant_limit(self, slot: Slot) -> None:
        """``--tenant-resident``: when the slot's tenant already holds its limit of sequences, park
        its least recently used idle slot; ``RATE_LIMITED`` when every one of them serves a request."""
        assert self.limits is not None
        tenant = slot.tenant
        while True:
            own = [s for s in self.owner if s is not None and s is not slot and s.tenant == tenant]
            if not self.limits.over_resident(len(own)):
                return
            idle = [s for s in own if not s.busy]
            if not idle or not self.can_park:
                raise self.limits.refuse(
                    tenant, "resident", f"tenant {tenant!r}'s slots hold {len(own)} engine sequences (its limit)"
                )
            victim = min(idle, key=lambda s: s.last_used)
            async with victim.lock:
                if not victim.busy and victim.seq is not None and self.owner[victim.seq] is victim:
                    await self.park(victim)
                    self.grant_free()

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
                    raise ServiceError(ErrorCode.CLIENT_GONE, "the client left while its request was queued")
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
                self.release_seq(slot)  # granted, but the waiter is gone: pass the sequence on
                self.grant_free()
            raise
        finally:
            self.queue.leave(ticket)

    def grant_free(self) -> None:
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
            except ServiceError as exc:  # the store is down: nobody gets a sequence until it is back
                self.queue.fail_all(exc)
                return
            self.grant_free()

    async def _evict_if_idle(self) -> int | None:
        """:meth:`_evict`, or None when every sequence serves a request (raises a store failure)."""
        try:
            return await self._evict()
        except ServiceError as exc:
            if exc.code != ErrorCode.RATE_LIMITED or not self.can_park:
                raise
            return None

    async def hand_over(self, slot: Slot) -> None:
        """Park ``slot`` (its last request just ended; lock held) for the requests queued for a sequence."""
        try:
            await self.park(slot)
        except ServiceError as exc:  # the store cannot take it: nobody gets a sequence until it can
            log.warning("could not park a slot for a queued request", slot_id=slot.id, error=exc.message)
            if exc.code == ErrorCode.STORE_UNAVAILABLE:
                self.queue.fail_all(exc)
            return
        self.grant_free()

    def _free_seq(self) -> int | None:
        """The free sequence (no owner, or a stale one from before a worker restart) freed last, None when
        every one has an owner.

        The worker gives an erased sequence's KV stream back to the kernel a few seconds after the erase
        (``engine/kv_release.py``); until then writing into it costs no page faults.  So the sequence a
        park or an erase just emptied is taken before one emptied long ago (a 46 MB restore: ~15 ms into
        resident pages, ~50 ms into given-back ones on a 2-core CPU; docs/benchmarks.md).  Sequences
        never held are taken lowest first.
        """
        gen = self.engine.generation
        best: int | None = None
        for i, s in enumerate(self.owner):
            if s is not None and s.engine_generation == gen and s.seq == i:
                continue
            if s is not None:  # held before the worker restarted: its cells are gone
                if s.seq == i:
                    s.seq = None
                self.owner[i] = None
                self._freed_at[i] = 0
            if best is None or self._freed_at[i] > self._freed_at[best]:
                best = i
        return best

    def release_seq(self, slot: Slot) -> None:
        """Free ``slot``'s sequence (if it still holds one) and remember when (:meth:`_free_seq`)."""
        if slot.seq is not None and 0 <= slot.seq < self.n_seqs and self.owner[slot.seq] is slot:
            self.owner[slot.seq] = None
            self._freed_at[slot.seq] = next(self._clock)
        slot.seq = None

    async def _evict(self) -> int:
        """Park the least recently used idle resident slot and return its sequence.

        Idle means no client request uses it; one that a background save holds right now
        is waited for (unlocked ones first).  ``RATE_LIMITED`` when every sequence serves
        a client request.
        """
        while True:
            idle = [s for s in self.owner if s is not None and not s.busy]
            if not idle:
                raise ServiceError(ErrorCode.RATE_LIMITED, f"all {self.n_seqs} engine sequences are busy")
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

    async def park_idle(self, idle_s: float | None) -> int:
        """Park every resident slot idle for more than its ``keep_alive_s`` seconds, else ``idle_s`` (None:
        only slots with a ``keep_alive_s``); parking frees its sequence and its lease, so another node may
        take the conversation.  Returns how many."""
        now = time.monotonic()
        parked = 0
        for slot in [s for s in self.owner if s is not None]:
            limit = slot.keep_alive_s if slot.keep_alive_s is not None else idle_s
            if limit is None or slot.busy or slot.lock.locked() or now - slot.last_used < limit:
                continue
            if not self.is_resident(slot):
                continue
            async with slot.lock:
                if not slot.busy and self.is_resident(slot):
                    await self.park(slot)
                    parked += 1
        self.grant_free()
        return parked

    def set_sequences(self, n_seqs: int) -> None:
        """The running worker serves ``n_seqs`` slot sequences (a standalone worker, ``--worker``, runs
        with its own ``-np``): slots resident beyond them lose their sequence (stored ones reload
        on use)."""
        for s in self.owner[n_seqs:]:
            if s is not None:
                s.seq = None
                if not s.stored:
                    s.n_tokens = 0
        self.owner = self.owner[:n_seqs] + [None] * (n_seqs - len(self.owner))
        self._freed_at = self._freed_at[:n_seqs] + [0] * (n_seqs - len(self._freed_at))
        self.n_seqs = n_seqs
        self.grant_free()

    def on_engine_restart(self) -> None:
        """The worker restarted: every resident slot lost its cells (stored ones reload on use)."""
        for i, s in enumerate(self.owner):
            if s is not None:
                s.seq = None
                if not s.stored:
                    s.n_tokens = 0
            self.owner[i] = None
            self._freed_at[i] = 0  # a new worker: every stream is given back, none is warmer
        self.grant_free()
