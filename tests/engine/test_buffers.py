"""BufferPool: lent views have the asked size, memory given back is reused, nothing read is reused, a
state's buffer is not spent on a small request, and memory kept idle is freed."""

from __future__ import annotations

import time

import numpy as np

from contract.buffers import FIT, PAGE, BufferPool


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
    c = pool.take(64)
    pool.give(c)
    pool.give(c)  # given twice (released by the first): ignored
    pool.drop(c)
    assert pool.held_bytes == 64


def test_lent_views_start_on_a_page_boundary() -> None:
    """The kernel copies into them from page-aligned sources (page cache, socket buffers) at full speed."""
    pool = BufferPool(keep=1)
    for n in (1, 4095, 46_000_000, 100):  # new buffers, then a kept one re-lent
        view = pool.take(n)
        assert len(view) == n
        assert np.frombuffer(view, dtype=np.uint8).ctypes.data % PAGE == 0
        pool.give(view)


def test_a_buffer_still_viewed_is_not_reused_and_one_never_given_back_is_freed() -> None:
    pool = BufferPool(keep=1)
    view = pool.take(1000)
    tail = view[500:]  # e.g. what uvloop keeps of a response body not yet written
    pool.give(view)
    assert pool.held_bytes == 0, "another view is alive: the memory must not be lent again"
    assert pool.take(1000).obj is not tail.obj
    tail[:1] = b"x"  # still usable
    old = id(tail.obj)
    del tail  # written: now it is free
    again = pool.take(1000)
    assert id(again.obj) == old, "lent again once no view of it is left"
    pool.give(again)
    lost = pool.take(1000)
    slice_ = lost[10:20]
    del lost
    pool.give(slice_)  # a slice, the last view, gives its buffer back too
    assert pool.held_bytes == 1000
    gone = pool.take(64)
    del gone  # never given back: nothing keeps it
    assert len(pool._lent) == 0


def test_a_big_buffer_is_not_lent_for_a_much_smaller_request() -> None:
    """A state's buffer (46 MB at 2,000 tokens) must not go to a token's frame (~2 MB), which would keep
    it while the next state is allocated afresh; a state of about the same size takes it."""
    pool = BufferPool(keep=2, idle_s=None)
    state = pool.take(46_000_000)
    kept = id(state.obj)  # (an id: a reference would count as a view still read)
    pool.give(state)
    token = pool.take(2_200_000)
    assert id(token.obj) != kept and pool.held_bytes == 46_000_000, "the state's buffer stays kept"
    pool.give(token)
    assert pool.held_bytes == 46_000_000 + 2_200_000
    small = pool.take(46_000_000 // FIT + 1)  # just within FIT of it: lent
    assert id(small.obj) == kept
    pool.give(small)


def test_kept_memory_is_freed_after_idle_s() -> None:
    now = [100.0]
    pool = BufferPool(keep=2, idle_s=5.0, clock=lambda: now[0])
    a, b = pool.take(1000), pool.take(3000)
    pool.give(a)  # free since t=100
    now[0] = 103.0
    pool.give(b)  # free since t=103
    assert pool.held_bytes == 4000
    now[0] = 104.9
    assert pool.release_idle() == 0 and pool.held_bytes == 4000
    now[0] = 105.0
    assert pool.release_idle() == 1000 + PAGE and pool.held_bytes == 3000, "only the one idle 5 s is freed"
    again = pool.take(2000)  # lent again: its idle time starts anew when given back
    now[0] = 109.0
    pool.give(again)
    now[0] = 113.0
    assert pool.release_idle() == 0 and pool.held_bytes == 3000
    now[0] = 114.0
    assert pool.release_idle() == 3000 + PAGE and pool.held_bytes == 0


def test_idle_memory_is_freed_without_any_further_call() -> None:
    """The pool's own timer frees what waits ``idle_s``: a server between conversations keeps nothing."""
    pool = BufferPool(keep=1, idle_s=0.05)
    pool.give(pool.take(1 << 20))
    deadline = time.monotonic() + 30  # a bound for a loaded machine, not a speed check
    while pool.held_bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.held_bytes == 0
    pool.give(pool.take(1 << 20))  # the timer starts again for memory kept later
    deadline = time.monotonic() + 30
    while pool.held_bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.held_bytes == 0


def test_a_recycled_buffer_comes_back_once_no_view_is_left_without_a_give() -> None:
    """A token's rows (``take(n, recycle=True)``): nobody gives them back, and each token's are a little bigger
    than the last's (one position more); the buffer is reused once the last view of it is gone, never before."""
    pool = BufferPool(keep=2, idle_s=None)
    row = 30 * 9 * 4  # float32 bytes one more position adds to SmolLM2's full rows (30 layers, 9 heads)
    first = pool.take(row * 4000, recycle=True)
    first[:4] = b"keep"
    kept = id(first.obj)
    second = pool.take(row * 4001, recycle=True)  # the first is still viewed: another buffer
    assert id(second.obj) != kept and bytes(first[:4]) == b"keep"
    del first
    third = pool.take(row * 4002, recycle=True)  # a little bigger, within the headroom: the first's memory
    assert id(third.obj) == kept
    assert id(pool.take(row * 4003, recycle=True).obj) != kept, "still viewed by `third`"
    pool.give(third)  # given back after all (a state's, say): released, and kept as given-back buffers are
    for _ in range(3):  # recycled buffers taken and let go meanwhile do not crowd it out
        pool.take(row * 4000, recycle=True)
    assert id(pool.take(row * 4003).obj) == kept


def test_arrays_over_recycled_buffers() -> None:
    pool = BufferPool(keep=2, idle_s=None)
    a = pool.array((30, 9, 100), np.float16)
    assert a.shape == (30, 9, 100) and a.dtype == np.float16 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % PAGE == 0
    a[...] = 1
    addr = a.ctypes.data
    view = a[3]  # a view of the array keeps its memory from being lent
    del a
    b = pool.array((30, 9, 100), np.float16)
    assert b.ctypes.data != addr and bool((view == 1).all())
    addrs = {addr, b.ctypes.data}
    del b, view
    assert pool.array((30, 9, 101), np.float16).ctypes.data in addrs
    empty = pool.array((30, 9, 0), np.float32)
    assert empty.shape == (30, 9, 0)


def test_recycled_buffers_kept_are_bounded() -> None:
    pool = BufferPool(keep=2, idle_s=None)
    views = [pool.take(1 << 20, recycle=True) for _ in range(5)]  # five frames in flight
    ids = [id(v.obj) for v in views]
    del views
    assert id(pool.take(1 << 20, recycle=True).obj) in ids[-2:], "only the last `keep` are kept; the others freed"
    assert pool.held_bytes <= 2 * ((1 << 20) + (1 << 20) // 8 + PAGE)


def test_buffers_given_back_do_not_crowd_out_the_recycled_ones() -> None:
    """Two bigger buffers given back (states, too big to lend to a token's frame) stay kept, and a stream's
    recycled buffers still cycle: each token lands in a buffer let go before."""
    pool = BufferPool(keep=2, idle_s=None)
    states = [pool.take(46_000_000), pool.take(40_000_000)]
    for v in states:
        pool.give(v)
    del states, v
    frame = pool.take(1 << 20, recycle=True)
    seen = {id(frame.obj)}
    del frame
    for k in range(4):
        frame = pool.take((1 << 20) + k * 1080, recycle=True)
        assert id(frame.obj) in seen, f"token {k} took a new buffer"
        del frame
    assert pool.held_bytes >= 86_000_000, "the states' buffers are still kept"
