"""The worker protocol's framing over a real socket pair (no model)."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from engine import protocol as proto


def test_request_round_trip_with_buffers() -> None:
    a, b = socket.socketpair()
    with a, b:
        state = np.arange(100_000, dtype=np.uint8).tobytes()
        proto.send_frame(a, proto.RestoreState(7, 2, [1, 2, 3]), [state])
        proto.send_frame(
            a,
            proto.Generate(
                8, 0, "generate", [5, 6], proto.SamplingParams(seed=3), proto.CaptureOptions(attention=True)
            ),
        )
        msg, bufs = proto.recv_request(b)
        assert msg == proto.RestoreState(7, 2, [1, 2, 3]) and bufs[0] == state
        msg, bufs = proto.recv_request(b)
        assert isinstance(msg, proto.Generate) and msg.params.seed == 3 and msg.capture.attention and bufs == []


def test_reply_round_trip_async() -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=b)
        att = np.random.default_rng(0).random((30, 9, 17), dtype=np.float32)
        tok = proto.Token(1, 0, 42, b"\xe2\x82", -0.5, [(42, -0.5)], 17, [30, 9, 17], has_attention=True)
        proto.send_frame(a, tok, [att])
        msg, bufs = await proto.read_reply(reader)
        assert msg == tok
        assert np.array_equal(np.frombuffer(bufs[0], dtype=np.float32).reshape(30, 9, 17), att)
        a.close()
        writer.close()

    asyncio.run(main())


def test_garbage_frames_are_rejected() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
        with pytest.raises(proto.ProtocolError):
            proto.recv_request(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\xff\xff\xff\x7f\x00\x00\x00\x00")  # absurd meta length
        with pytest.raises(proto.ProtocolError):
            proto.recv_request(b)
    a, b = socket.socketpair()
    with b:
        a.sendall(b"\x10\x00")
        a.close()
        with pytest.raises(proto.ProtocolError):
            proto.recv_request(b)
