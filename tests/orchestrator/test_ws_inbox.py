"""The WebSocket inbox (``orchestrator/api/native/ws.py``, ``Inbox``) is bounded: past its bound the
server stops reading the socket (backpressure), and reads again as messages are served."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from contract.errors import ErrorCode
from orchestrator.api.native.ws import INBOX_MESSAGES, Inbox, _Closed
from orchestrator.web.errors import ApiError


class FloodingSocket:
    """A client that has ``n`` messages of ``size`` bytes ready, then leaves; counts the reads."""

    def __init__(self, n: int, size: int) -> None:
        self.left = n
        self.size = size
        self.reads = 0

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        if self.left == 0:
            return {"type": "websocket.disconnect", "code": 1000}
        self.left -= 1
        return {"type": "websocket.receive", "bytes": bytes([self.reads % 256]) * self.size}


async def _settle() -> None:
    for _ in range(20):  # let the reader task run as far as it can
        await asyncio.sleep(0)


def test_the_server_stops_reading_past_the_message_bound() -> None:
    async def main() -> None:
        sock = FloodingSocket(100, 10)
        inbox = Inbox(sock, limit=1000)  # type: ignore[arg-type]
        await _settle()
        assert sock.reads == INBOX_MESSAGES and len(inbox.items) == INBOX_MESSAGES
        first = await inbox.get()
        assert first == b"\x01" * 10
        await _settle()
        assert sock.reads == INBOX_MESSAGES + 1  # one served, one more read
        inbox.put_back(first)  # the next request, kept in front
        assert await inbox.get() == first
        got = 1
        while True:  # every message comes through, in order, then the close
            try:
                msg = await inbox.get()
            except _Closed:
                break
            got += 1
            assert msg == bytes([got % 256]) * 10
        assert got == 100
        with pytest.raises(_Closed):
            await inbox.get()  # closed for every later get
        await inbox.close()

    asyncio.run(main())


def test_the_server_stops_reading_past_the_byte_bound() -> None:
    async def main() -> None:
        sock = FloodingSocket(10, 400)
        inbox = Inbox(sock, limit=1000)  # type: ignore[arg-type]
        await _settle()
        assert sock.reads == 3 and inbox.size == 1200  # read while under 1000 bytes wait
        for n in range(4, 8):  # each one served makes room for one more: never 2 * 1000 bytes
            await inbox.get()
            await _settle()
            assert sock.reads == n and inbox.size == 1200
        await inbox.close()

    asyncio.run(main())


def test_an_oversized_message_is_an_error_in_its_place() -> None:
    async def main() -> None:
        sock = FloodingSocket(2, 2000)
        inbox = Inbox(sock, limit=1000)  # type: ignore[arg-type]
        with pytest.raises(ApiError) as exc:
            await inbox.get()
        assert exc.value.code is ErrorCode.PAYLOAD_TOO_LARGE and inbox.size == 0
        await inbox.close()

    asyncio.run(main())
