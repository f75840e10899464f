"""The SSE event frame slotserve writes is the frame Litestar's generic encoder builds."""

from __future__ import annotations

import msgspec
import pytest
from litestar.response.sse import ServerSentEventMessage

from orchestrator.api.native.generate import _sse


@pytest.mark.parametrize(
    "obj",
    [
        {"token": "héllo\nworld\r\n", "type": "token"},
        {"type": "done", "finish_reason": "stop", "stop": "\u2028<|im_end|>"},
        {"attention": {"data": "A" * 100_000, "shape": [30, 9, 500]}, "index": 3},
    ],
)
def test_json_event_frame_equals_litestar_encoding(obj: dict[str, object]) -> None:
    data = msgspec.json.encode(obj)
    assert b"\n" not in data and b"\r" not in data
    want = ServerSentEventMessage(data=data.decode(), event="message", sep="\n").encode()
    got = _sse(obj).encode()
    assert got == want
    assert got.startswith(b"event: message\ndata: {") and got.endswith(b"}\n\n")
