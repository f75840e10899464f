"""The worker's outbox: frames in order, bulk frames written off the sender's thread, ``done`` once written."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from contract import protocol as proto
from contract.framing import FrameStream, recv_frame
from contract.shm import RegionLender, RegionWriter, SharedRegion
from engine.outbox import BULK_BYTES, Outbox


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # a bulk frame cannot fit the kernel's buffer
    yield a, b
    a.close()
    b.close()


def _blob(n: int, fill: int) -> np.ndarray:
    return np.full(n, fill, dtype=np.uint8)


def _read(sock: socket.socket) -> tuple[proto.Reply, list[bytes]]:
    meta, bufs = recv_frame(sock)
    return proto._reply_decoder.decode(meta), [bytes(b) for b in bufs]


def _in_thread(fn: object) -> threading.Thread:
    t = threading.Thread(target=fn)  # type: ignore[arg-type]
    t.start()
    return t


def test_a_bulk_frame_does_not_block_its_sender_and_order_is_kept(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    box = Outbox(a)
    big = _blob(8 * BULK_BYTES, 7)
    released: list[str] = []

    def sender() -> None:  # nobody reads yet: a blocking write of 8 MiB could not end
        box.send(proto.StateBlob(1, 0, [1, 2], 0.0, proto.Tensor.raw(big)), [big], lambda: released.append("big"))
        box.send(proto.SeqTokens(2, 0, [3]), ())  # small, but queued behind the bulk frame
        box.send(proto.SeqTokens(3, 0, [4]), (), lambda: released.append("small"))

    t = _in_thread(sender)
    t.join(60)
    assert not t.is_alive(), "the sender waited for the reader"
    assert released == []  # not written yet: the reader has not read
    first, bufs = _read(b)
    assert isinstance(first, proto.StateBlob) and first.req == 1
    assert bufs == [big.tobytes()]
    second, _ = _read(b)
    third, _ = _read(b)
    assert (second.req, third.req) == (2, 3)
    box.close()
    assert released == ["big", "small"]


def test_a_small_frame_with_nothing_queued_is_written_by_its_sender(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    box = Outbox(a)
    seen: list[str] = []
    box.send(proto.SeqTokens(5, 1, [9, 8]), (), lambda: seen.append(threading.current_thread().name))
    assert seen == [threading.current_thread().name]
    msg, _ = _read(b)
    assert isinstance(msg, proto.SeqTokens) and msg.tokens == [9, 8]
    box.close()


def test_close_writes_what_is_queued(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    box = Outbox(a)
    big = _blob(2 * BULK_BYTES, 3)
    box.send(proto.StateBlob(1, 0, [], 0.0, proto.Tensor.raw(big)), [big])
    box.send(proto.Stopped(2), ())
    got: list[proto.Reply] = []
    reader = _in_thread(lambda: got.extend([_read(b)[0], _read(b)[0]]))
    box.close()
    reader.join(60)
    assert [m.req for m in got] == [1, 2]
    box.send(proto.Stopped(3), ())  # after close: dropped, not written
    a.close()
    assert b.recv(1) == b""


def test_a_gone_peer_drops_frames_calls_done_and_raises(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    box = Outbox(a)
    b.close()
    done: list[int] = []
    big = _blob(2 * BULK_BYTES, 1)
    box.send(proto.StateBlob(1, 0, [], 0.0, proto.Tensor.raw(big)), [big], lambda: done.append(1))
    box.close()  # the writer met the closed peer and dropped the frame
    assert done == [1]
    with pytest.raises(OSError):
        Outbox(a).send(proto.SeqTokens(2, 0, []), (), lambda: done.append(2))
    assert done == [1, 2]


def test_a_tokens_bulk_tensors_go_through_the_region_on_the_writer_thread() -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        region = SharedRegion.create(16 * BULK_BYTES)
        assert region.fd is not None
        writer = RegionWriter(SharedRegion.attach(region.fd))  # the worker's mapping of the same memory
        _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)
        stream.region = RegionLender(region, lambda offsets: None)
        box = Outbox(a, writer)
        rows = np.arange(BULK_BYTES // 2, dtype=np.float32)  # 2 MiB of attention rows
        box.send(proto.Token(1, 0, 42, b"x", attention=proto.Tensor.of(rows, 0)), [rows.data])
        state = _blob(2 * BULK_BYTES, 5)
        box.send(proto.StateBlob(2, 0, [], 0.0, proto.Tensor.raw(state)), [state])  # not a token's: inline
        first, bufs = await proto.read_reply(stream)
        assert isinstance(first, proto.Token) and np.array_equal(np.frombuffer(bufs[0], np.float32), rows)
        second, bufs2 = await proto.read_reply(stream)
        assert isinstance(second, proto.StateBlob) and bytes(bufs2[0]) == state.tobytes()
        assert (writer.shared, writer.inline) == (1, 0)
        del bufs, bufs2
        box.close()
        stream.close()
        a.close()

    asyncio.run(main())
