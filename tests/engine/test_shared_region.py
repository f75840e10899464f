"""The shared region of tokens' tensors (contract/shm.py): its allocator (out-of-order frees, reuse of the
start while the end is held, full), the worker's placement, and the orchestrator's stream reading
``FLAG_SHARED`` frames as views that go back (``Release``) once no view of them is left; bad frames refused."""

from __future__ import annotations

import asyncio
import gc
import random
import socket

import numpy as np
import pytest

from contract import protocol as proto
from contract.framing import FrameStream, ProtocolError, frame_chunks, recv_frame, shared_frame_chunks
from contract.shm import ALIGN, RangeAllocator, RegionLender, RegionWriter, SharedRegion


def test_allocator_frees_out_of_order_and_merges() -> None:
    a = RangeAllocator(1024)
    offs = [a.alloc(100) or 0 for _ in range(8)]  # 128 bytes each, aligned
    assert offs == [i * 128 for i in range(8)]
    assert a.alloc(1) is None and a.free_bytes == 0  # full
    for i in (5, 1, 6, 0, 7, 3):  # out of order
        assert a.free(offs[i])
    assert a.free_bytes == 6 * 128
    assert a.alloc(256) == 0  # 0 and 1 merged
    assert a.alloc(384) == 5 * 128  # 5, 6 and 7 merged (3 alone is 128)
    assert a.alloc(128) == 3 * 128
    assert a.alloc(1) is None


def test_allocator_reuses_the_start_while_the_end_is_held() -> None:
    """What a ring does at its wrap-around: the oldest ranges come back first and are reused while later
    ones (a stream that stopped reading) are still held."""
    a = RangeAllocator(10 * ALIGN)
    held = [a.alloc(ALIGN) for _ in range(10)]
    assert held == [i * ALIGN for i in range(10)]
    for i in range(7):
        a.free(i * ALIGN)
    assert a.alloc(7 * ALIGN) == 0
    assert a.alloc(ALIGN) is None


def test_allocator_ignores_what_it_did_not_lend() -> None:
    a = RangeAllocator(4096)
    off = a.alloc(10)
    assert off == 0
    assert not a.free(64) and not a.free(-1) and not a.free(1 << 40)
    assert a.free(0) and not a.free(0)  # a second release of one range changes nothing
    assert a.free_bytes == 4096


def test_allocator_random_workload_keeps_its_books() -> None:
    rng = random.Random(7)
    a = RangeAllocator(1 << 16)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.5:
            gone = rng.choice(list(live))
            assert a.free(gone)
            del live[gone]
        else:
            n = rng.choice([1, 63, 64, 65, 1000, 4096, 20000])
            got = a.alloc(n)
            if got is not None:
                end = got + -(-n // ALIGN) * ALIGN
                assert got >= 0 and end <= 1 << 16
                assert all(end <= o or o + m <= got for o, m in live.items())  # never overlaps
                live[got] = end - got
        assert a.free_bytes == (1 << 16) - sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.free_bytes == 1 << 16 and a.alloc(1 << 16) == 0


def test_writer_places_buffers_and_falls_back_when_full() -> None:
    region = SharedRegion.create(4 * ALIGN)
    region.close_fd()
    w = RegionWriter(region)
    a = np.arange(10, dtype=np.float32)
    b = np.arange(3, dtype=np.int32)
    spans = w.place([a.data, b.data])
    assert spans == [(0, 40), (ALIGN, 12)]
    assert region.mm[0:40] == a.tobytes() and region.mm[ALIGN : ALIGN + 12] == b.tobytes()
    assert w.place([np.zeros(3 * ALIGN, np.uint8).data]) is None  # no room: the caller sends it inline
    assert (w.shared, w.inline) == (1, 1)
    w.release([0, 12345])  # an unknown offset is ignored
    assert w.ranges.free_bytes == 4 * ALIGN


async def _stream(region: SharedRegion | None) -> tuple[socket.socket, FrameStream, list[list[int]]]:
    a, b = socket.socketpair()
    _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)
    released: list[list[int]] = []
    if region is not None:
        stream.region = RegionLender(region, released.append)
    return a, stream, released


def test_stream_lends_views_and_releases_them_when_the_last_is_gone() -> None:
    async def main() -> None:
        region = SharedRegion.create(1 << 20)
        assert region.fd is not None
        attached = SharedRegion.attach(region.fd)  # the worker's mapping of the same memory
        w = RegionWriter(attached)
        a, stream, released = await _stream(region)
        rows = np.random.default_rng(0).random((2, 3, 50), dtype=np.float32)
        spans = w.place([rows.data, np.arange(4, dtype=np.int32).data])
        assert spans is not None
        a.sendall(b"".join(bytes(c) for c in shared_frame_chunks(b"meta", spans)))
        a.sendall(b"".join(bytes(c) for c in frame_chunks(b"inline", [b"xyz"])))  # inline frames still work
        meta, bufs = await stream.read_frame()
        assert bytes(meta) == b"meta" and all(isinstance(x, memoryview) for x in bufs)
        assert bytes(bufs[0]) == rows.tobytes() and np.frombuffer(bufs[1], np.int32).tolist() == [0, 1, 2, 3]
        meta2, bufs2 = await stream.read_frame()
        assert (bytes(meta2), [bytes(x) for x in bufs2]) == (b"inline", [b"xyz"])
        lender = stream.region
        assert isinstance(lender, RegionLender) and lender.lent_bytes > 0
        keep = np.frombuffer(bufs[0], np.float32)  # a consumer's array over the view keeps the range
        del bufs
        gc.collect()
        await asyncio.sleep(0)
        assert released == []
        del keep
        await asyncio.sleep(0)
        assert released == [[spans[0][0]]] and lender.lent_bytes == 0
        w.release(released[0])
        assert w.ranges.free_bytes == 1 << 20
        stream.close()
        a.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "spans",
    [[(1 << 20, 1)], [(0, (1 << 20) + 1)], [((1 << 20) - 8, 16)], []],
    ids=["past-the-end", "too-long", "straddles-the-end", "no-buffer"],
)
def test_stream_refuses_a_shared_frame_outside_the_region(spans: list[tuple[int, int]]) -> None:
    async def main() -> None:
        region = SharedRegion.create(1 << 20)
        a, stream, released = await _stream(region)
        a.sendall(b"".join(bytes(c) for c in shared_frame_chunks(b"m", spans)))
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(stream.read_frame(), 10)
        assert released == []
        a.close()

    asyncio.run(main())


def test_a_stream_without_a_region_refuses_shared_frames() -> None:
    async def main() -> None:
        a, stream, _ = await _stream(None)
        a.sendall(b"".join(bytes(c) for c in shared_frame_chunks(b"m", [(0, 4)])))
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(stream.read_frame(), 10)
        a.close()

    asyncio.run(main())


def test_the_worker_refuses_shared_frames() -> None:
    """Requests never carry shared buffers: the worker's reader refuses the flag."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(bytes(c) for c in shared_frame_chunks(b"m", [(0, 4)])))
        with pytest.raises(ProtocolError):
            recv_frame(b)


def test_release_is_a_request() -> None:
    a, b = socket.socketpair()
    with a, b:
        proto.send_frame(a, proto.Release(0, [0, 4096]))
        msg, bufs = proto.recv_request(b)
        assert msg == proto.Release(0, [0, 4096]) and bufs == []
