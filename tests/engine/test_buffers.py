"""BufferPool: lent views have the asked size, memory given back is reused, nothing read is reused."""

from __future__ import annotations

import numpy as np

from engine.buffers import BufferPool


def test_given_back_memory_is_reused_and_kept_within_bounds() -> None:
    pool = BufferPool(keep=1, max_bytes=1000)
    a = pool.take(100)
    assert len(a) == 100 and not a.readonly
    a[:3] = b"abc"
    addr = np.frombuffer(a, dtype=np.uint8).ctypes.data
    pool.give(a)
    assert pool.held_bytes == 100
    b = pool.take(60)  # fits in the kept buffer: the same memory
    assert len(b) == 60 and np.frombuffer(b, dtype=np.uint8).ctypes.data == addr
    c = pool.take(60)  # the kept one is lent: a new buffer
    assert np.frombuffer(c, dtype=np.uint8).ctypes.data != addr
    pool.give(b)
    pool.give(c)
    assert pool.held_bytes == 100, "keeps one buffer, the biggest"
    big = pool.take(5000)
    pool.give(big)
    assert pool.held_bytes == 100, "a buffer over max_bytes is not kept"


def test_a_dropped_or_foreign_view_is_not_reused() -> None:
    pool = BufferPool(keep=2)
    b = pool.take(64)
    pool.drop(b)
    pool.give(b)  # forgotten: ignored
    assert pool.held_bytes == 0
    pool.give(memoryview(bytearray(10)))  # not lent by the pool: ignored
    assert pool.held_bytes == 0
