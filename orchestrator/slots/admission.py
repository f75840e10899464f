"""Fair admission: a bounded queue of requests waiting for a free engine sequence, served
round-robin between tenants.

With more conversations than ``--parallel`` sequences, a request whose slot is not resident
needs a sequence that another slot holds.  Instead of refusing it (``RATE_LIMITED``), it
waits here, as llama-server defers a task when no slot is idle and KoboldCpp queues concurrent
requests.  Each tenant has its own first-come-first-served lane; the lanes take turns (one
ticket each, round-robin, a tenant that arrives joining the end of the turn order), so a
tenant with many waiting requests delays another tenant's request by at most one turn
(one generation) per other tenant waiting.  The :class:`orchestrator.slots.registry.SlotRegistry`
owns the sequences and uses this queue only for the order:

* ``ticket = queue.enter(slot)``: join the back of the slot's tenant's lane (``RATE_LIMITED``,
  HTTP 429 with ``retry_after`` seconds, when ``max_waiting`` tickets already wait);
* ``await ticket.wait(timeout, interrupt)``: the granted sequence index, or ``None`` when
  the timeout passed, the ticket's position changed (``ticket.position``: 1 = next) or
  ``interrupt`` (an ``asyncio.Event``, e.g. "the client left") was set;
* ``queue.pop()``: the ticket whose turn it is, which the registry then grants a sequence
  (``ticket.grant(seq)``) or fails (``ticket.fail(error)``);
* ``queue.leave(ticket)``: always, when the waiter stops waiting (granted, timed out, or
  its client left: the task was cancelled), so its place is freed at once.

A ticket's tenant is the requesting tenant (``WaitHooks.tenant``), else the slot's ``tenant``
attribute (its owner; :data:`DEFAULT_TENANT` without one).
Options (``slotserve serve``): ``--queue-size`` (``max_waiting``; 0 turns waiting off and
restores the immediate 429) and ``--queue-timeout`` (``max_wait_s``, seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from contract.errors import ErrorCode
from orchestrator import metrics
from orchestrator.service_error import ServiceError
from orchestrator.tenants.principal import DEFAULT_TENANT

S = TypeVar("S")  # what waits: the registry's Slot (the queue never looks inside it)
T = TypeVar("T")


class Ticket(Generic[S]):
    """One waiting request's place in an :class:`AdmissionQueue`."""

    def __init__(self, queue: AdmissionQueue[S], slot: S) -> None:
        self.queue = queue
        self.slot = slot
        self.tenant = tenant_of(slot)  # slots are per tenant: the slot's owner is the requesting tenant
        self.outcome: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.moved = asyncio.Event()

    @property
    def position(self) -> int:
        """1-based place in the order the queue will serve (1 = served next, counting every tenant's
        turn before it); 0 once it left or was served."""
        try:
            return self.queue.waiting_tickets.index(self) + 1
        except ValueError:
            return 0

    def grant(self, seq: int) -> None:
        """Hand this waiter engine sequence ``seq`` (the registry already made it the owner)."""
        if not self.outcome.done():
            self.outcome.set_result(seq)

    def fail(self, error: ServiceError) -> None:
        """End this wait with ``error`` (raised in the waiter)."""
        if not self.outcome.done():
            self.outcome.set_exception(error)

    async def wait(self, timeout: float, interrupt: asyncio.Event | None = None) -> int | None:
        """The granted sequence, or None after ``timeout`` seconds, a change of position, or
        ``interrupt`` being set.  Raises the error passed to :meth:`fail`."""
        self.moved.clear()
        watchers = [asyncio.ensure_future(e.wait()) for e in (self.moved, interrupt) if e is not None]
        waited: set[asyncio.Future[Any]] = {self.outcome, *watchers}
        try:
            await asyncio.wait(waited, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in watchers:
                w.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w
        return self.outcome.result() if self.outcome.done() else None


def tenant_of(waiter: object) -> str:
    """The tenant a waiter belongs to: its ``tenant`` attribute (a slot's owner), else :data:`DEFAULT_TENANT`."""
    tenant = getattr(waiter, "tenant", None)
    return tenant if isinstance(tenant, str) else DEFAULT_TENANT


class AdmissionQueue(Generic[S]):
    """Bounded queue of :class:`Ticket` s in per-tenant lanes served round-robin (see module docstring).

    ``max_waiting``: tickets that may wait at once, all tenants together (0: none, every request
    that finds no sequence gets ``RATE_LIMITED`` at once).  ``max_wait_s``: how long one may wait
    before ``RATE_LIMITED``.  ``retry_after_s``: the ``Retry-After`` a refused client is told.
    """

    def __init__(self, max_waiting: int, max_wait_s: float, retry_after_s: int = 1) -> None:
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self.lanes: dict[str, deque[Ticket[S]]] = {}  # tenant -> its waiting tickets; dict order = turn order
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def waiting_tickets(self) -> list[Ticket[S]]:
        """Every waiting ticket in the order it will be served if no one else arrives: the head of
        each lane in turn order, then the second of each, and so on."""
        lanes = list(self.lanes.values())
        depth = max((len(lane) for lane in lanes), default=0)
        return [lane[i] for i in range(depth) for lane in lanes if i < len(lane)]

    def waiting(self, tenant: str) -> int:
        """Tickets of ``tenant`` waiting now."""
        lane = self.lanes.get(tenant)
        return len(lane) if lane is not None else 0

    def refusal(self, message: str) -> ServiceError:
        """``RATE_LIMITED`` with ``retry_after`` (seconds; HTTP answers carry it as ``Retry-After``)."""
        return ServiceError(ErrorCode.RATE_LIMITED, message, retry_after=self.retry_after_s)

    def enter(self, slot: S) -> Ticket[S]:
        """Join the back of the slot's tenant's lane (:func:`tenant_of`); a new lane joins the end of the
        turn order.  ``RATE_LIMITED`` when the queue is full."""
        if self._count >= self.max_waiting:
            metrics.QUEUE_REFUSED.labels("full").inc()
            raise self.refusal(f"every engine sequence is busy and {self._count} requests already wait (--queue-size)")
        ticket = Ticket(self, slot)
        self.lanes.setdefault(ticket.tenant, deque()).append(ticket)
        self._count += 1
        metrics.TENANT_WAITING.labels(ticket.tenant).set(len(self.lanes[ticket.tenant]))
        return ticket

    def pop(self) -> Ticket[S] | None:
        """Remove and return the ticket whose turn it is: the head of the first lane, whose tenant
        then goes to the end of the turn order (None if nobody waits); the others move up."""
        if not self.lanes:
            return None
        tenant = next(iter(self.lanes))
        lane = self.lanes.pop(tenant)
        ticket = lane.popleft()
        if lane:
            self.lanes[tenant] = lane  # re-inserted: the end of the turn order
        self._count -= 1
        metrics.TENANT_WAITING.labels(tenant).set(len(lane))
        self._moved()
        return ticket

    def leave(self, ticket: Ticket[S]) -> None:
        """Drop ``ticket`` wherever it is (no-op if it already left); the ones behind move up."""
        lane = self.lanes.get(ticket.tenant)
        if lane is None:
            return
        with contextlib.suppress(ValueError):
            lane.remove(ticket)
            self._count -= 1
            if not lane:
                del self.lanes[ticket.tenant]
            metrics.TENANT_WAITING.labels(ticket.tenant).set(len(lane))
            self._moved()

    def fail_all(self, error: ServiceError) -> int:
        """Fail every waiting ticket with ``error`` (e.g. the store is down: nothing can be parked)."""
        n = 0
        while (ticket := self.pop()) is not None:
            ticket.fail(error)
            n += 1
        return n

    def _moved(self) -> None:
        for lane in self.lanes.values():
            for t in lane:
                t.moved.set()


class WaitHooks:
    """What a waiting request's handler wants to hear: its position, and whether its client left.

    ``on_position(n)`` is awaited whenever the position changes (1 = next).  Setting
    ``gone`` (the client disconnected) ends the wait with ``CLIENT_GONE``: a wait in the
    queue, and any other wait run through :meth:`unless_gone` (e.g. for a busy slot's lock).
    """

    def __init__(self, on_position: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.on_position = on_position
        self.gone = asyncio.Event()

    def check(self, what: str) -> None:
        """``CLIENT_GONE`` if the client already left (``what``: what it was waiting for)."""
        if self.gone.is_set():
            raise ServiceError(ErrorCode.CLIENT_GONE, f"the client left while its request waited for {what}")

    async def unless_gone(self, aw: Awaitable[T], what: str) -> T:
        """Await ``aw``; if ``gone`` is set first, cancel it and raise ``CLIENT_GONE``.

        ``aw`` must undo itself when cancelled (``asyncio.Lock.acquire`` does), so a client
        that left takes nothing: a result that came at the same moment as ``gone`` is kept
        (the caller checks :meth:`check` after it if it must not act on it)."""
        task = asyncio.ensure_future(aw)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if task.cancelled():
            self.check(what)
        return task.result()
