"""FrameStream, the orchestrator's asyncio end of the worker stream: every frame arrives whole and
in order whatever the chunking, large buffers land in place, a cut or malformed stream is an error."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import threading
import weakref

import numpy as np
import pytest

from contract import framing
from contract.buffers import PAGE, BufferPool
from contract.framing import MAX_META_BYTES, POOLED_BYTES, STAGING_BYTES, FrameStream, ProtocolError, frame_chunks

SIZES = [0, 1, 7, STAGING_BYTES // 2 - 3, STAGING_BYTES // 2 + 1, STAGING_BYTES + 5, 3 * STAGING_BYTES + 11, 5_000_000]


def _frames(rng: random.Random, n: int) -> list[tuple[bytes, list[bytes]]]:
    out = []
    for _ in range(n):
        meta = os.urandom(rng.choice([0, 1, 30, 500, STAGING_BYTES + 3]))
        bufs = [os.urandom(rng.choice(SIZES)) for _ in range(rng.choice([0, 1, 2, 3]))]
        out.append((meta, bufs))
    return out


def _wire(frames: list[tuple[bytes, list[bytes]]]) -> bytes:
    return b"".join(bytes(c) for meta, bufs in frames for c in frame_chunks(meta, bufs))


async def _read_all(data: bytes, n_frames: int, chunking: random.Random | None) -> list[tuple[bytes, list[bytes]]]:
    a, b = socket.socketpair()
    _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)

    def send() -> None:  # from a thread: cut into random pieces, as a slow peer would write them
        with a:
            pos = 0
            while pos < len(data):
                step = chunking.choice([1, 2, 13, 4096, 70_000, 1 << 20]) if chunking else len(data)
                a.sendall(data[pos : pos + step])
                pos += step

    t = threading.Thread(target=send)
    t.start()
    try:
        got = []
        for _ in range(n_frames):
            meta, bufs = await asyncio.wait_for(stream.read_frame(), 30)
            assert isinstance(meta, bytearray)
            for x in bufs:  # big buffers land in RECEIVE_POOL's page-aligned memory, the rest in bytearrays
                if len(x) >= POOLED_BYTES:
                    assert isinstance(x, memoryview) and not x.readonly
                    assert np.frombuffer(x, dtype=np.uint8).ctypes.data % PAGE == 0
                else:
                    assert isinstance(x, bytearray)
            got.append((bytes(meta), [bytes(x) for x in bufs]))
        with pytest.raises(ProtocolError, match="closed"):  # then the peer's close
            await asyncio.wait_for(stream.read_frame(), 30)
        return got
    finally:
        stream.close()
        await asyncio.to_thread(t.join)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frames_arrive_whole_and_in_order_whatever_the_chunking(seed: int) -> None:
    rng = random.Random(seed)
    frames = _frames(rng, 25)
    assert asyncio.run(_read_all(_wire(frames), len(frames), rng)) == frames
    assert asyncio.run(_read_all(_wire(frames), len(frames), None)) == frames


@pytest.mark.parametrize(
    "data, match",
    [
        (_wire([(b"abc", [b"x" * 10])])[:-3], "closed"),  # cut inside a buffer
        (_wire([(b"abc", [])])[:5], "closed"),  # cut inside the header
        (struct.pack("<IHH", MAX_META_BYTES + 1, 0, 0), "too large"),
        (struct.pack("<IHH", 1, 60_000, 0), "buffers"),
    ],
    ids=["cut-buffer", "cut-header", "huge-meta", "too-many-buffers"],
)
def test_a_cut_or_malformed_stream_is_an_error(data: bytes, match: str) -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)
        with a:
            a.sendall(data)
            if match == "closed":
                a.shutdown(socket.SHUT_WR)
            with pytest.raises(ProtocolError, match=match):
                await asyncio.wait_for(stream.read_frame(), 10)
            with pytest.raises(ProtocolError):  # and stays failed
                stream.write([b"x"])
        stream.close()

    asyncio.run(main())


def test_writes_reach_the_peer() -> None:
    async def main() -> bytes:
        a, b = socket.socketpair()
        _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)
        payload = os.urandom(3_000_000)
        received = bytearray()

        def recv() -> None:
            while len(received) < len(payload):
                received.extend(a.recv(1 << 20))

        t = threading.Thread(target=recv)
        t.start()
        stream.write([payload[:10], memoryview(payload)[10:]])
        await stream.drain()
        await asyncio.to_thread(t.join, 30)
        a.close()
        stream.close()
        assert bytes(received) == payload
        return bytes(received)

    assert len(asyncio.run(main())) == 3_000_000


def test_a_token_frames_buffer_is_lent_again_once_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens' full rows (megabytes each, one position bigger every token) are received into recycled memory:
    once the previous token's buffers are let go, the next lands in them, not in fresh zeroed pages; a buffer
    still read is never written over."""
    monkeypatch.setattr(framing, "RECEIVE_POOL", BufferPool(keep=2))  # none kept from other tests
    row = 30 * 9 * 4  # float32 bytes one position adds to SmolLM2-135M's full rows
    tokens = [os.urandom(row * n) for n in (2000, 2001, 2002)]
    go = [threading.Event() for _ in tokens]

    def send(a: socket.socket) -> None:  # one token when the reader asks for it: what arrives is received at once
        for x, ev in zip(tokens, go, strict=True):
            if not ev.wait(30):
                return
            a.sendall(_wire([(b"tok", [x])]))

    async def next_buffer(stream: FrameStream, k: int) -> memoryview:
        go[k].set()
        _, (buf,) = await asyncio.wait_for(stream.read_frame(), 30)
        assert isinstance(buf, memoryview) and bytes(buf) == tokens[k]
        return buf

    async def main() -> None:
        a, b = socket.socketpair()
        _, stream = await asyncio.get_running_loop().connect_accepted_socket(FrameStream, b)
        t = threading.Thread(target=send, args=(a,))
        t.start()
        try:
            held = await next_buffer(stream, 0)  # a slow client still sending it
            second = await next_buffer(stream, 1)
            assert second.obj is not held.obj, "a buffer still read was reused"
            owner = weakref.ref(second.obj)
            del second  # sent: let go
            third = await next_buffer(stream, 2)
            assert third.obj is owner(), "the let-go buffer was not lent again"
            assert bytes(held) == tokens[0]
        finally:
            for ev in go:
                ev.set()
            stream.close()
            await asyncio.to_thread(t.join)
            a.close()

    asyncio.run(main())
