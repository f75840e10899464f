"""Large binary WebSocket messages written as header + payload (orchestrator/web/ws_frames.py) reach a
standard client byte for byte, at every length encoding, beside text and small messages; a send after the
client left raises instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest
import uvicorn
import websockets
from websockets.frames import Frame, Opcode

from orchestrator.web import ws_frames
from orchestrator.web.ws_frames import ZERO_COPY_BYTES, ZeroCopyWebSocketProtocol, frame_header
from tests.redis_server import free_port

SIZES = [0, 10, 125, 126, ZERO_COPY_BYTES - 1, ZERO_COPY_BYTES, 65535, 65536, 70_001, 4_400_000]


def test_the_header_is_the_one_websockets_writes() -> None:
    for n in [*SIZES, 1 << 16, (1 << 16) - 1]:
        data = bytes(n)
        assert frame_header(n) + data == Frame(Opcode.BINARY, data).serialize(mask=False), n


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def serve(app: Any, deflate: bool = False) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    """``app`` under uvicorn with the protocol, as orchestrator/cli.py runs it (no permessage-deflate
    unless ``deflate``: then every message takes uvicorn's own path, compressed)."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        ws=ZeroCopyWebSocketProtocol,
        ws_per_message_deflate=deflate,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, port


@pytest.mark.asyncio
@pytest.mark.parametrize("deflate", [False, True])
async def test_messages_of_every_size_arrive_exactly(deflate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    headers: list[int] = []

    def spy(n: int) -> bytes:
        headers.append(n)
        return frame_header(n)

    monkeypatch.setattr(ws_frames, "frame_header", spy)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "websocket"
        await receive()
        await send({"type": "websocket.accept"})
        for i, n in enumerate(SIZES):
            # a memoryview of a numpy array, as the attention stream sends it
            await send({"type": "websocket.send", "bytes": memoryview(payload(n, i)), "text": None})
            await send({"type": "websocket.send", "bytes": None, "text": f"after {n}"})
        await send({"type": "websocket.close", "code": 1000})

    server, task, port = await serve(app, deflate)
    try:
        async with websockets.connect(f"ws://127.0.0.1:{port}/", max_size=None) as ws:
            for i, n in enumerate(SIZES):
                got = await ws.recv()
                assert isinstance(got, bytes) and got == payload(n, i).tobytes(), n
                assert await ws.recv() == f"after {n}"
            with pytest.raises(websockets.ConnectionClosedOK):
                await ws.recv()
        assert headers == ([] if deflate else [n for n in SIZES if n >= ZERO_COPY_BYTES]), "which path wrote"
    finally:
        server.should_exit = True
        await task


@pytest.mark.asyncio
async def test_a_send_after_the_client_left_raises() -> None:
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        big = memoryview(payload(1 << 20, 0))
        try:
            for _ in range(10_000):  # ~10 GB if nobody stopped it: the client leaves after one message
                await send({"type": "websocket.send", "bytes": big, "text": None})
        except Exception as exc:  # uvicorn's ClientDisconnected (an OSError)
            outcome.set_result(type(exc).__name__)
            raise
        outcome.set_result("sent everything")

    server, task, port = await serve(app)
    try:
        async with websockets.connect(f"ws://127.0.0.1:{port}/", max_size=None) as ws:
            assert len(await ws.recv()) == 1 << 20
        assert await asyncio.wait_for(outcome, 30) == "ClientDisconnected"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task
