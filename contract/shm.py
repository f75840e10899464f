"""Shared memory between the orchestrator and the engine worker it spawned: where tokens' tensors travel.

A token's attention rows (``float32[n_layers, n_heads, n_ctx]``: 2.2 MB for SmolLM2-135M at 2,000 tokens
of context) would otherwise cross the worker's Unix socket: a blocking ``sendmsg`` on the decode thread
(a copy into the kernel), a copy out of it into a fresh buffer in the orchestrator.  Instead the
orchestrator creates one region (:meth:`SharedRegion.create`: ``memfd_create(2)`` + ``mmap``, so nothing
lives in the file system and the memory goes with the last mapping) and hands its descriptor to the worker
it spawns (``--shm-fd``, inherited through ``pass_fds``).  Then:

* the worker (:class:`RegionWriter`) copies a token's buffers into a free range of the region
  (:class:`RangeAllocator`, first fit: generations interleave, so ranges come back out of order) and
  sends a small frame that names ``(offset, length)`` of each buffer instead of carrying its bytes
  (``FLAG_SHARED``, :mod:`contract.framing`); when no range is free it sends the bytes inline, as before:
  the decode loop never waits for room;
* the orchestrator (:class:`RegionLender`) hands its consumers ``memoryview`` s of the region (no copy) and,
  once no view of a range is left (the WebSocket, SSE or JSON writer has written it, the stream was closed or
  its client went away), sends the range's offset back (``Release``, :mod:`contract.protocol`), batched per
  event-loop turn; the worker frees it (:meth:`RangeAllocator.free`).

Each worker gets a region of its own: a restarted worker never writes into a mapping whose views an older
connection still lends.  A worker reached over TCP (``--listen``) has none and sends everything inline.
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np

ALIGN = 64
"""Ranges start on this boundary (bytes): a cache line, and every dtype's alignment."""


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class SharedRegion:
    """One ``mmap`` of a memfd, ``size`` bytes.  ``fd``: the descriptor while this process keeps it open
    (the creator, until its worker has inherited it); None once closed."""

    def __init__(self, mm: mmap.mmap, fd: int | None) -> None:
        self.mm = mm
        self.fd = fd
        self.size = len(mm)

    @classmethod
    def create(cls, size: int) -> SharedRegion:
        """A new anonymous region of ``size`` bytes (``memfd_create`` with close-on-exec; OSError where the
        kernel has none)."""
        fd = os.memfd_create("slotserve-stream", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(mmap.mmap(fd, size), fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> SharedRegion:
        """Map the region of descriptor ``fd`` (its size from ``fstat``) and close ``fd``."""
        try:
            return cls(mmap.mmap(fd, os.fstat(fd).st_size), None)
        finally:
            os.close(fd)

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class RangeAllocator:
    """First-fit allocator of byte ranges of a region of ``size`` bytes; thread-safe.

    ``alloc(n)`` returns the offset of a free range of at least ``n`` bytes (rounded up to :data:`ALIGN`),
    or None when no free range is that long; ``free(offset)`` returns a range in any order (neighbouring free
    ranges merge), False for an offset not allocated (a confused or stale sender: nothing changes).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]  # free ranges, ascending and never adjacent
        self._ends: list[int] = [size]
        self._used: dict[int, int] = {}  # offset -> length
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` bytes (see the class docstring)."""
        n = _aligned(n)
        with self._lock:
            for i, (s, e) in enumerate(zip(self._starts, self._ends, strict=True)):
                if e - s >= n:
                    if e - s == n:
                        del self._starts[i], self._ends[i]
                    else:
                        self._starts[i] = s + n
                    self._used[s] = n
                    return s
        return None

    def free(self, offset: int) -> bool:
        """Give back the range at ``offset``; False (nothing changed) when none is allocated there."""
        with self._lock:
            n = self._used.pop(offset, None)
            if n is None:
                return False
            s, e = offset, offset + n
            i = bisect.bisect_left(self._starts, s)
            if i > 0 and self._ends[i - 1] == s:  # merge with the free range before
                i -= 1
                s = self._starts[i]
                del self._starts[i], self._ends[i]
            if i < len(self._starts) and self._starts[i] == e:  # and the one after
                e = self._ends[i]
                del self._starts[i], self._ends[i]
            self._starts.insert(i, s)
            self._ends.insert(i, e)
            return True

    @property
    def free_bytes(self) -> int:
        """Bytes in free ranges."""
        with self._lock:
            return self.size - sum(self._used.values())


class RegionWriter:
    """The worker's side: places a frame's buffers in the region (see the module docstring).

    ``shared`` / ``inline`` count the frames placed and those that found no room.
    """

    def __init__(self, region: SharedRegion) -> None:
        self.region = region
        self.ranges = RangeAllocator(region.size)
        self.shared = 0
        self.inline = 0

    def place(self, buffers: Sequence[memoryview]) -> list[tuple[int, int]] | None:
        """Copy C-contiguous ``buffers`` into one free range, each at an :data:`ALIGN` boundary:
        ``[(offset, nbytes), ...]``, the first offset the range's (what ``Release`` names); None when no range
        is free (nothing copied)."""
        views = [memoryview(b).cast("B") for b in buffers]
        offset = self.ranges.alloc(sum(_aligned(v.nbytes) for v in views))
        if offset is None:
            self.inline += 1
            return None
        spans = []
        at = offset
        for v in views:
            self.region.mm[at : at + v.nbytes] = v
            spans.append((at, v.nbytes))
            at += _aligned(v.nbytes)
        self.shared += 1
        return spans

    def release(self, offsets: Sequence[int]) -> None:
        """Free the ranges at ``offsets`` (a ``Release``); unknown offsets are ignored."""
        for off in offsets:
            self.ranges.free(off)


class RegionLender:
    """The orchestrator's side: lends views of the region named by a frame and reports each range back
    once no view of it is left (see the module docstring).

    ``release(offsets)`` is called on the event loop that created the lender, at most once per loop turn,
    with every range returned since; exceptions from it are the caller's (the connection may be closed: it
    drops them).  ``lent_bytes``: bytes of ranges lent and not yet returned.
    """

    def __init__(self, region: SharedRegion, release: Callable[[list[int]], None] | None = None) -> None:
        self.region = region
        self.release = release
        self.lent_bytes = 0
        self._pending: list[int] = []
        self._lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._scheduled = False

    def lend(self, spans: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views ``uint8[length]`` of each ``(offset, length)`` of one range (whose start is the least offset).
        ValueError when a span is outside the region or there is none."""
        if not spans:
            raise ValueError("a shared frame names no buffer")
        start = min(o for o, _ in spans)
        end = max(o + n for o, n in spans)
        if start < 0 or any(n < 0 for _, n in spans) or end > self.region.size:
            raise ValueError(f"shared buffers {list(spans)} outside the region of {self.region.size} bytes")
        owner = np.frombuffer(self.region.mm, np.uint8, end - start, start)
        nbytes = end - start
        with self._lock:
            self.lent_bytes += nbytes
        weakref.finalize(owner, self._returned, start, nbytes)
        base = memoryview(owner)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
        del owner  # the views alone keep the range
        return [base[o - start : o - start + n] for o, n in spans]

    def _returned(self, offset: int, nbytes: int) -> None:
        """The last view of the range at ``offset`` is gone (any thread)."""
        with self._lock:
            self.lent_bytes -= nbytes
            self._pending.append(offset)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            if threading.get_ident() == self._thread:
                self._loop.call_soon(self._flush)
            else:
                self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: the worker and its region are gone with it
            pass

    def _flush(self) -> None:
        with self._lock:
            offsets, self._pending, self._scheduled = self._pending, [], False
        if offsets and self.release is not None:
            self.release(offsets)
