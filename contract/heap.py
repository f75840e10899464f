"""Keep glibc from mapping and unmapping memory for every per-token array.

Each generated token with attention allocates arrays of hundreds of KB and frees them a step
later: the worker's ``float32[n_layer, n_head, n_kv]`` rows (``Engine.new_target``), the
orchestrator's receive buffer for them (``contract.framing.FrameStream``).  glibc serves an
allocation above its mmap threshold with a fresh ``mmap`` and returns it with ``munmap`` on
``free``; its dynamic threshold (raised to the size of the last such block freed) does not help
when every token's array is a little bigger than the last (one more cell of context).  Every
token then pays a page fault per 4 KiB of its arrays: measured on the project's 2-core VM
(KVM, where a fault costs ~3 us), allocating and filling one ``float32[30, 9, 200..700]`` per
step took 289 us per token, against 15 us from a heap that keeps its pages; at ~13 ms a
decode step that is ~2% of decode speed per process the array crosses.

:func:`keep_heap_mapped` sets glibc's ``M_MMAP_THRESHOLD`` (``mallopt(3)``, ``malloc.h``) so that
blocks up to :data:`MMAP_THRESHOLD` come from the heap, whose freed pages are reused while
mapped, and ``M_TRIM_THRESHOLD`` so that up to :data:`TRIM_THRESHOLD` of free memory at the
heap's top stays mapped.  The cost: a process keeps up to that much freed memory.  Larger
blocks (a whole slot state, tens of MB) are still mapped and unmapped, and are pooled where
they recur (:mod:`contract.buffers`).  Once a process goes idle, :func:`trim_heap` gives the
heap's free pages back (``malloc_trim(3)``): what a turn's arrays and KV records left is not held
between conversations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this many bytes come from the heap (glibc's default: 128 KiB, raised dynamically up to 32 MiB)."""

TRIM_THRESHOLD = 64 << 20
"""Free memory at the heap's top kept mapped (glibc's default: 128 KiB, twice the dynamic mmap threshold)."""

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def keep_heap_mapped() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring) for this process; ``False``
    (and nothing changed) where the C library is not glibc or refuses them."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.info("mallopt refused the heap thresholds: per-token arrays may be mapped afresh each step")
    return done


def trim_heap() -> bool:
    """Give the free pages of glibc's heaps back to the kernel (``malloc_trim(0)``, ``malloc.h``): every
    arena's free memory, not only the top's beyond :data:`TRIM_THRESHOLD`.  Thread-safe; it walks the
    heap and the pages it gives back fault in again when reused, so callers do it when idle, not per
    token.  Returns
    whether memory was released (``False`` also where the C library is not glibc)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
