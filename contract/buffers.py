"""Reused receive buffers for slot states, so a state of tens of MB lands in memory already mapped, page-aligned.

A fresh buffer of a state's size costs more than the copy into it: its pages are
faulted in one by one on first touch (measured on the project's 2-core VM: a fresh 46 MB
``bytearray`` ~35-40 ms, rewriting one already touched ~5 ms; ``benchmarks/bench_table.py``
prints the save/restore figures this affects).  glibc serves such sizes with ``mmap`` and
returns them to the kernel on ``free``, so every state would pay that again.  A
:class:`BufferPool` keeps the buffers given back to it (up to ``keep`` of them, each at most
``max_bytes``) and lends a view of one big enough, and not much bigger: a state's buffer is not
spent on a per-token frame, which would keep it and leave the next state to be allocated afresh.
Memory is given back when idle: a kept buffer not lent again within ``idle_s`` seconds is freed
(and glibc's heap trimmed, :func:`contract.heap.trim_heap`), so a server between conversations
holds no state-sized buffer.

The views start on a page boundary.  glibc puts a big ``malloc`` (a ``bytearray``'s memory) 16
bytes into a page, and the kernel's copy into such a buffer from the page cache or a socket
(``read`` / ``recv_into``), whose source starts on a page boundary, stores 16 bytes ahead of
where it loads modulo 4 KiB: every load then waits on a store it falsely aliases.  Measured on the
project's VM (AMD EPYC): a 46 MB slot file read into a ``bytearray`` in 30 ms, into the same
memory from its next page boundary in 6 ms.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from contract.heap import trim_heap

T = TypeVar("T")

PAGE = 4096

MAX_KEPT_BYTES = 256 << 20
"""Default ``max_bytes``: a buffer bigger than this (a long context's state) is freed when given back."""

IDLE_S = 5.0
"""Default ``idle_s``: seconds a kept buffer may wait to be lent again before it is freed."""

FIT = 2
"""A kept buffer is lent for ``n`` bytes only while it holds at most ``FIT * n`` (a state's buffer is
not spent on a token's frame)."""


HEADROOM = 8
"""A recycled buffer is made ``1 / HEADROOM`` bigger than asked (at least a page): a token's attention rows
grow by one position per token, and a buffer exactly the size of one token's would never fit the next."""


def _trim(items: list[T], keep: int, buffer: Callable[[T], _Buffer]) -> list[T]:
    """The last ``keep`` of ``items`` of each kind (given back, recycled), in order: the recycled buffers a
    stream cycles through are not crowded out by a bigger one given back (a state's), nor the other way."""
    if not keep:
        return []
    given = [x for x in items if not buffer(x).recycled][-keep:]
    recycled = [x for x in items if buffer(x).recycled][-keep:]
    kept = {id(x) for x in given + recycled}
    return [x for x in items if id(x) in kept]


def _headroom(n: int) -> int:
    return -(-max(n // HEADROOM, PAGE) // PAGE) * PAGE


class _Buffer(bytearray):
    """A pool's ``bytearray``: weakly referenceable, so a lent one is tracked without being kept alive."""

    __slots__ = ("__weakref__", "recycled")

    recycled: bool  # lent by take(recycle=True) and not given back: kept apart, the most recent first


def _owner(view: object) -> object:
    """The object a memoryview views (``None`` for anything else, or a view already released)."""
    try:
        return view.obj if isinstance(view, memoryview) else None
    except ValueError:  # released: given back (or dropped) before
        return None


def _page_view(buf: bytearray, n: int) -> memoryview:
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0
    start = -addr % PAGE
    return memoryview(buf)[start : start + n]


class BufferPool:
    """Lends writable ``memoryview`` s of ``n`` bytes over kept ``bytearray`` s; thread-safe.

    ``take(n)`` returns a view of exactly ``n`` bytes starting on a page boundary (of a kept
    buffer big enough, or of a new one; contents undefined); ``give(view)`` (the view or any
    slice of it) returns it once nothing reads it any more, ``drop(view)`` forgets it when that
    is not known.  Views not taken from the pool are ignored by both.  A lent buffer is not kept
    alive by the pool: one never given back is freed with its last view.  A buffer given back is
    lent again only once no other view of it is left: uvloop, for one, keeps views of a response
    body until the socket has taken all of it, after the ASGI ``send`` returned.  Memory held: at
    most ``keep`` buffers of at most ``max_bytes`` each free, and ``keep`` given back and still
    viewed; a free buffer is lent for ``n`` bytes only if it holds at most :data:`FIT` ``* n``, and
    is freed once it waited ``idle_s`` seconds (by :meth:`release_idle`, which a timer thread calls
    while anything is kept; ``idle_s`` None: kept until the pool goes).  ``clock``: seconds,
    monotonic (tests give their own).
    """

    def __init__(
        self,
        keep: int = 1,
        max_bytes: int = MAX_KEPT_BYTES,
        idle_s: float | None = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self._clock = clock
        self._free: list[tuple[float, _Buffer]] = []  # (when it became free, buffer)
        self._returned: list[_Buffer] = []  # given back while a view of them may still be read
        self._lent: weakref.WeakValueDictionary[int, _Buffer] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def take(self, n: int, recycle: bool = False) -> memoryview:
        """A writable view of ``n`` bytes (``uint8``).

        ``recycle``: the buffer comes back by itself once no view of it is left, with no :meth:`give` (for
        a frame whose readers are not told when they are done: a token's attention rows, read by a client's
        transport, another thread, a socket), and a new one is made :data:`HEADROOM` bigger, so that the
        next frame of a context grown by a few tokens fits it."""
        with self._lock:
            self._settle()
            fits = [e for e in self._free if n <= len(e[1]) - PAGE <= FIT * n]
            entry = min(fits, key=lambda e: len(e[1])) if fits else None
            buf = None
            if entry is not None:
                self._free = [e for e in self._free if e is not entry]  # by identity: == compares bytes
                buf = entry[1]
        if buf is None:
            buf = _Buffer(n + PAGE + (_headroom(n) if recycle else 0))
        buf.recycled = recycle
        with self._lock:
            if recycle:
                self._return(buf)
            else:
                self._lent[id(buf)] = buf
        return _page_view(buf, n)

    def array(self, shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray[Any, Any]:
        """An uninitialised C-contiguous ``ndarray`` of ``shape`` and ``dtype`` over a recycled buffer
        (:meth:`take` with ``recycle``): reused once the array and every view of it are gone."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if not n:
            return np.empty(shape, dt)
        return np.frombuffer(self.take(n, recycle=True), dtype=dt).reshape(shape)

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
        """Take back a view lent by :meth:`take`, or a slice of one (releasing it); anything else is left alone."""
        buf = _owner(view)
        if not isinstance(buf, _Buffer):
            return
        with self._lock:
            if buf.recycled and any(b is buf for b in self._returned):
                buf.recycled = False  # given back after all (a state): kept as the given-back ones are
                with contextlib.suppress(BufferError):  # another view of it is alive: it comes back later
                    view.release()  # type: ignore[attr-defined]
                return
            if self._lent.get(id(buf)) is not buf:
                return
            del self._lent[id(buf)]
        try:
            view.release()  # type: ignore[attr-defined]
        except BufferError:  # a C extension still holds the view's buffer: not reused
            return
        with self._lock:
            self._return(buf)
            del buf  # this frame's reference must not count as a view
            self._settle()

    def _return(self, buf: _Buffer) -> None:
        """Keep ``buf`` (lock held) to be lent again once no view reaches it (unless it is over ``max_bytes``)."""
        if len(buf) - PAGE > self.max_bytes:
            return
        self._returned.append(buf)
        self._returned = _trim(self._returned, self.keep, lambda b: b)  # the oldest are left to be freed
        self._arm()

    def _settle(self) -> None:
        """Move the returned buffers that no view reaches any more (lock held) to the free ones."""
        busy: list[_Buffer] = []
        now = self._clock()
        for b in self._returned:
            # the references: the list's, `b` and getrefcount's argument; a live view of b adds one
            if sys.getrefcount(b) <= 3:
                self._free.append((now, b))
            else:
                busy.append(b)
        self._returned = busy
        # given back: the biggest kept; recycled: the most recently freed
        self._free.sort(key=lambda e: e[0] if e[1].recycled else len(e[1]))
        self._free = _trim(self._free, self.keep, lambda e: e[1])

    def release_idle(self) -> int:
        """Free the kept buffers that waited ``idle_s`` seconds or more; then, if any was freed, trim
        glibc's heap (:func:`contract.heap.trim_heap`).  Returns the bytes freed."""
        with self._lock:
            self._settle()
            if self.idle_s is None:
                return 0
            now = self._clock()
            old = [e for e in self._free if now - e[0] >= self.idle_s]
            self._free = [e for e in self._free if now - e[0] < self.idle_s]
            freed = sum(len(b) for _, b in old)
            del old
        if freed:
            trim_heap()
        return freed

    def _arm(self) -> None:
        """Start the idle timer (lock held) if memory is kept and none runs."""
        if self.idle_s is None or self._timer is not None or not (self._free or self._returned):
            return
        self._timer = threading.Timer(self.idle_s, self._on_timer)
        self._timer.daemon = True
        self._timer.start()

    def _on_timer(self) -> None:
        self.release_idle()
        with self._lock:
            self._timer = None
            self._arm()

    def drop(self, view: object) -> None:
        """Forget a lent view without reusing its memory (something may still read it)."""
        buf = _owner(view)
        with self._lock:
            if isinstance(buf, _Buffer) and self._lent.get(id(buf)) is buf:
                del self._lent[id(buf)]

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers kept for reuse (what they can lend; each holds a page more, for the alignment)."""
        with self._lock:
            return sum(len(b) - PAGE for _, b in self._free)
