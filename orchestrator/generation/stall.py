"""Stalled readers: a generation whose client takes nothing for ``--stall-timeout`` seconds.

Flow control (:mod:`contract.flow`) keeps a slow client's generation from running ahead of it:
the engine holds the generation's sequence while the client's window is spent.  A client that
stops reading altogether (its socket open, its receive buffer full) would then hold an engine
sequence for as long as its socket lives, and ``--parallel`` such clients would stop the server.
A :class:`StallGuard` watches one generation: when the token it offered has not been taken for
``timeout_s`` seconds it runs ``on_stall`` once (the generation service stops the generation and
parks its slot: the KV state of the prompt and of every token generated is stored, the sequence
goes to the next waiting request).  When the client reads again it gets the tokens generated
before the stop and the end of the generation (``finish_reason`` ``cancelled``); when it is gone
the request ends as any other whose client left.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from orchestrator import metrics
from orchestrator.engine_client.interface import EngineClient
from orchestrator.slots.model import Slot
from orchestrator.slots.registry import SlotRegistry

log = structlog.get_logger("slotserve.generate")

ENGINE_END_S = 5.0
"""How long :func:`park_stalled` waits for the worker to end a cancelled generation (it does so
at its next decode step), seconds."""


async def park_stalled(engine: EngineClient, registry: SlotRegistry, slot: Slot, req: int, tenant: str) -> None:
    """Generation ``req`` of ``tenant``'s request on ``slot`` (whose lock that request holds) has a
    client that took nothing for ``--stall-timeout``: cancel it, wait until the worker has ended it,
    then park the slot (its KV state stored) and hand its sequence to the next waiting request."""
    log.info("client stalled: generation stopped, slot parked", slot_id=slot.id)
    metrics.STALLED.labels(tenant).inc()
    seq = slot.seq
    await engine.cancel(req)
    deadline = time.monotonic() + ENGINE_END_S
    while seq in (await engine.engine_state()).generating and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await registry.residency.hand_over(slot)


class StallGuard:
    """Runs ``on_stall`` once when an offered event stays untaken for ``timeout_s`` seconds.

    The generation calls :meth:`offered` before it hands its consumer an event and awaits
    :meth:`taken` when the consumer asks for the next one (which waits for a running
    ``on_stall`` to finish, so the two never touch the slot at once); :meth:`close` at its end.
    ``clock``: seconds, monotonic (a test's fake clock).
    """

    def __init__(
        self,
        timeout_s: float,
        on_stall: Callable[[], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self.clock = clock
        self.fired = False
        self._since: float | None = None  # when the event now offered was offered (None: none is)
        self._offered = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._action: asyncio.Task[None] | None = None

    def offered(self) -> None:
        """An event is about to be handed to the consumer (nothing is watched with ``timeout_s`` 0)."""
        if self.fired or self.timeout_s <= 0:
            return
        self._since = self.clock()
        self._offered.set()
        if self._watch is None:
            self._watch = asyncio.create_task(self._run(), name="stall-guard")

    async def taken(self) -> None:
        """The consumer took the event (it asks for the next); waits for a running ``on_stall``."""
        self._since = None
        self._offered.clear()
        if self._action is not None:
            await asyncio.shield(self._action)

    async def close(self) -> None:
        """Stop watching; a running ``on_stall`` is waited for even if the caller is cancelled."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._action is not None:
            try:
                await asyncio.shield(self._action)
            except asyncio.CancelledError:
                await self._action
                raise

    async def _run(self) -> None:
        while True:
            await self._offered.wait()
            since = self._since
            if since is None:
                self._offered.clear()
                continue
            left = since + self.timeout_s - self.clock()
            if left > 0:
                await asyncio.sleep(left)
                continue
            self.fired = True
            self._action = asyncio.create_task(self._fire(), name="stall-park")
            return

    async def _fire(self) -> None:
        try:
            await self.on_stall()
        except Exception as exc:  # the generation goes on as it can; its own end reports a failure
            log.warning("stalled generation could not be parked", error=str(exc))
