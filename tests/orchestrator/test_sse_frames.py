"""The SSE event frame slotserve writes is the frame Litestar's generic encoder builds."""

from __future__ import annotations

import msgspec
import pytest
from litestar.response.sse import ServerSentEventMessage

from orchestrator.api.common.kobold import KoboldTokenEvent
from orchestrator.api.common.wire import Attention, TokenText
from orchestrator.api.native.protocol import DoneEvent, SseTokenEvent
from orchestrator.web.sse import json_event

ATTENTION = Attention(
    format="per_layer", shape=[30, 9, 500], context_length=500, encoding="base64", dtype="float32", data="A" * 100_000
)


@pytest.mark.parametrize(
    "obj",
    [
        KoboldTokenEvent(token="héllo\nworld\r\n"),
        DoneEvent(
            request_id=None,
            finish_reason="stop_string",
            total_tokens=3,
            generation_time_ms=1.5,
            prompt_tokens=2,
            cached_tokens=0,
            slot_id=0,
            stop_string="\u2028<|im_end|>",
        ),
        SseTokenEvent(token=TokenText(token_id=3, text="a\nb"), request_id="r", attention=ATTENTION),
    ],
)
def test_json_event_frame_equals_litestar_encoding(obj: msgspec.Struct) -> None:
    data = msgspec.json.encode(obj)
    assert b"\n" not in data and b"\r" not in data
    want = ServerSentEventMessage(data=data.decode(), event="message", sep="\n").encode()
    got = json_event(obj).encode()
    assert got == want
    assert got.startswith(b"event: message\ndata: {") and got.endswith(b"}\n\n")
