"""Binary WebSocket messages written without copying their payload (the attention stream's frames).

uvicorn's sans-I/O WebSocket protocol (``uvicorn/protocols/websockets/websockets_sansio_impl.py``)
sends a message through ``websockets``' ``Protocol.send_binary``, whose ``Frame.serialize``
(``websockets/frames.py``) writes the header and the payload into an ``io.BytesIO`` and returns
``getvalue()``: two copies of every payload before the transport sees it, 9 MB of memory traffic for
each 4.4 MB token of per-layer attention (SmolLM2-135M at 4,000 tokens of context).  A server frame
is never masked (RFC 6455 section 5.1) and slotserve negotiates no extension (``ws_per_message_deflate``
off, ``orchestrator/cli.py``), so its bytes are a 2-10 byte header (RFC 6455 section 5.2) followed by
the payload as it is: :class:`ZeroCopyWebSocketProtocol` writes exactly that, the header and a view
of the caller's buffer, for binary messages of at least :data:`ZERO_COPY_BYTES`; everything else
(text, small messages, the handshake, close, a connection not open) goes through uvicorn unchanged.
"""

from __future__ import annotations

import struct
import sys

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Opcode
from websockets.protocol import State

ZERO_COPY_BYTES = 64 << 10
"""Binary messages this large or larger skip the serializer's copies; below, the copy costs less than a
second write to the transport."""


def frame_header(n: int) -> bytes:
    """The header of one unmasked, final binary frame of ``n`` payload bytes (RFC 6455 section 5.2:
    FIN + opcode 2, then a 7-bit, 16-bit or 64-bit big-endian payload length)."""
    first = 0x80 | Opcode.BINARY
    if n < 126:
        return struct.pack("!BB", first, n)
    if n < 1 << 16:
        return struct.pack("!BBH", first, 126, n)
    return struct.pack("!BBQ", first, 127, n)


class ZeroCopyWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol whose large binary messages are written as a frame header
    plus the payload itself (see the module docstring); pass the class as ``uvicorn.Config(ws=...)``.

    Raises ``ClientDisconnected`` (uvicorn's; Litestar turns it into ``WebSocketDisconnect``) for a send on
    a connection that is closing or closed, as uvicorn's own path does.
    """

    async def send(self, message: ASGISendEvent) -> None:
        """Send one ASGI ``websocket.*`` event; see the class docstring."""
        data = message.get("bytes") if message["type"] == "websocket.send" else None
        if (
            data is None
            or memoryview(data).nbytes < ZERO_COPY_BYTES
            or not self.handshake_complete
            or self.close_sent
            or self.initial_response is not None
            or self.conn.extensions
            or self.conn.expect_continuation_frame
        ):
            await super().send(message)
            return
        await self.writable.wait()
        if self.disconnected or self.conn.state is not State.OPEN:
            raise ClientDisconnected()
        payload = memoryview(data).cast("B")
        self.transport.write(frame_header(payload.nbytes))
        # Python 3.11's selector transport sends what the socket takes at once and copies the rest; 3.12+
        # may keep a view of the payload until it is sent, after the caller has reused its buffer: there
        # the payload is handed over as bytes (one copy, still one fewer than the serializer's).
        self.transport.write(payload if sys.version_info < (3, 12) else payload.tobytes())
