"""Reused receive buffers for slot states, so a state of tens of MB lands in memory already mapped.

A fresh buffer of a state's size costs more than the copy into it: its pages are
faulted in one by one on first touch (measured on the project's 2-core VM: a fresh 46 MB
``bytearray`` ~35-40 ms, rewriting one already touched ~5 ms; ``benchmarks/bench_table.py``
prints the save/restore figures this affects).  glibc serves such sizes with ``mmap`` and
returns them to the kernel on ``free``, so every state would pay that again.  A
:class:`BufferPool` keeps the buffers given back to it (up to ``keep`` of them, each at most
``max_bytes``) and lends a view of one big enough.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class BufferPool:
    """Lends writable ``memoryview`` s of ``n`` bytes over kept ``bytearray`` s; thread-safe.

    ``take(n)`` returns a view of exactly ``n`` bytes (of a kept buffer at least that big, or
    of a new one; contents undefined); ``give(view)`` returns it once nothing reads it any
    more, ``drop(view)`` forgets it when that is not known (its memory is then freed with its
    last reference).  Views not taken from the pool are ignored by both.  Memory held: at
    most ``keep`` buffers of at most ``max_bytes`` each.
    """

    def __init__(self, keep: int = 1, max_bytes: int = 1 << 30) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._free: list[bytearray] = []
        self._lent: dict[int, bytearray] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes (``uint8``)."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= n]
            buf = min(fits, key=len) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = bytearray(n)
        view = memoryview(buf)[:n]
        with self._lock:
            self._lent[id(view)] = buf
        return view

    def fill(self, read: Callable[[Callable[[int], memoryview]], T]) -> T:
        """``read(take)``: what it returns holds the views it took from this pool (give them back
        when done); when it raises, every view it took goes back at once."""
        taken: list[memoryview] = []

        def take(n: int) -> memoryview:
            taken.append(self.take(n))
            return taken[-1]

        try:
            return read(take)
        except BaseException:
            for view in taken:
                self.give(view)
            raise

    def give(self, view: object) -> None:
        """Take back a view lent by :meth:`take` (releasing it); anything else is left alone."""
        with self._lock:
            buf = self._lent.pop(id(view), None)
        if buf is None:
            return
        try:
            view.release()  # type: ignore[attr-defined]
        except BufferError:  # a C extension still holds the view's buffer: not reused
            return
        if len(buf) > self.max_bytes:
            return
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len, reverse=True)
            del self._free[self.keep :]  # keep the biggest ones

    def drop(self, view: object) -> None:
        """Forget a lent view without reusing its memory (something may still read it)."""
        with self._lock:
            self._lent.pop(id(view), None)

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers kept for reuse."""
        with self._lock:
            return sum(len(b) for b in self._free)
