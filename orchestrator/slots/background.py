"""Background loops the slot registry runs: the coalescing write-behind and periodic upkeep.

They know nothing of slots: each is handed the registry's coroutine to call.

* :class:`WriteBehind`: :meth:`WriteBehind.wake` asks for a flush; the loop waits
  ``delay_s`` seconds (so a burst of wakes becomes one flush), calls ``flush()``, and calls
  it again while ``pending()`` says work is left.  A flush that raises
  :class:`orchestrator.service_error.ServiceError` (the store is down) is retried with exponential
  backoff from 0.5 s up to 30 s.
* :func:`every`: call ``step()`` every ``period_s`` seconds; a failure is logged, the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from orchestrator.service_error import ServiceError

log = structlog.get_logger("slotserve.background")


class WriteBehind:
    """A coalescing flush loop (see module docstring); run :meth:`run` as a task."""

    def __init__(self, flush: Callable[[], Awaitable[object]], pending: Callable[[], bool], delay_s: float) -> None:
        self.flush = flush
        self.pending = pending
        self.delay_s = delay_s
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Ask for a flush within ``delay_s`` seconds (wakes meanwhile are coalesced)."""
        self._wake.set()

    async def run(self) -> None:
        """The loop (runs until cancelled)."""
        backoff = 0.5
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.delay_s)
            try:
                await self.flush()
                backoff = 0.5
            except ServiceError as exc:
                log.warning("write-behind failed; retrying", error=exc.message, retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
                self._wake.set()
            except Exception as exc:
                log.exception("write-behind error", error=str(exc))
                await asyncio.sleep(backoff)
                self._wake.set()
            if self.pending():
                self._wake.set()


async def every(period_s: float, step: Callable[[], Awaitable[object]], what: str) -> None:
    """Await ``step()`` every ``period_s`` seconds until cancelled; failures are logged as ``what``."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await step()
        except Exception as exc:
            log.warning("background step failed", step=what, error=str(exc))


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling a task again while it goes on: on Python 3.11
    ``asyncio.wait_for`` (the store calls' deadline) loses a cancellation that comes as its call finishes
    (CPython bpo-42130), and the task would then wait for its next wake-up forever."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        while not t.done():
            await asyncio.wait({t}, timeout=0.5)
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
