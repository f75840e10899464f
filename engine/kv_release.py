"""When an emptied sequence's KV stream is given back to the kernel (``Engine.release``).

Giving a stream's pages back (``llama_attn_kv_seqs_release``, libllama/llama-attn.h) makes the next write into
them fault a page in, zero-filled by the kernel, per 4 KiB: a restore of 46 MB into a given-back stream takes
3-4x one into resident pages (docs/benchmarks.md), and ``MADV_POPULATE_WRITE`` beforehand saves only the
fault's trap, not the zeroing.  The commonest restores come right after a stream empties: a slot parked to
make room for another that is restored from the store at once, a client's erase then restore, a preview's
spare forked into again.  So an erase does not give the stream back at once: it is due
:data:`RELEASE_DELAY_S` later, and given back then if it still holds no cells (the worker's loop asks
:meth:`ReleaseSchedule.due`, busy or idle).  Memory at rest is unchanged; for those seconds an emptied stream
stays resident, as every stream of llama-server always is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["RELEASE_DELAY_S", "ReleaseSchedule"]

RELEASE_DELAY_S = 5.0
"""Seconds an emptied sequence's stream stays resident before it is given back."""


class ReleaseSchedule:
    """Which emptied sequences' streams are due to be given back, and when (``clock``: seconds)."""

    def __init__(self, delay_s: float = RELEASE_DELAY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.delay_s = delay_s
        self._clock = clock
        self._due: dict[int, float] = {}

    def schedule(self, seq: int) -> None:
        """``seq`` was emptied now: due ``delay_s`` from now (a later erase moves it on)."""
        self._due[seq] = self._clock() + self.delay_s

    def clear(self) -> None:
        """Forget every pending release (all were just given back)."""
        self._due.clear()

    def due(self) -> list[int]:
        """The sequences whose time has come, forgotten from here (the caller releases those still empty)."""
        if not self._due:
            return []
        now = self._clock()
        ready = [seq for seq, t in self._due.items() if t <= now]
        for seq in ready:
            del self._due[seq]
        return ready

    def next_in(self) -> float | None:
        """Seconds until the next release is due (0 when one is), None when none is pending."""
        if not self._due:
            return None
        return max(0.0, min(self._due.values()) - self._clock())
