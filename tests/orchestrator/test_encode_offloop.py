"""Large stream events are built and encoded off the event loop (``orchestrator/web/encode.py``)."""

from __future__ import annotations

import asyncio
import threading

import msgspec

from orchestrator.web.encode import OFFLOAD_BYTES, encoded, encoded_text


class Event(msgspec.Struct):
    data: str
    thread: str


def test_small_events_are_encoded_in_place_and_large_ones_in_a_thread() -> None:
    async def main() -> tuple[bytes, str, str]:
        loop_thread = threading.current_thread().name

        def build() -> Event:
            return Event(data="x" * 10, thread=threading.current_thread().name)

        small = await encoded(build, OFFLOAD_BYTES - 1)
        large = await encoded_text(build, OFFLOAD_BYTES)
        return small, large, loop_thread

    small, large, loop_thread = asyncio.run(main())
    assert msgspec.json.decode(small, type=Event).thread == loop_thread
    big = msgspec.json.decode(large, type=Event)
    assert big.thread != loop_thread and big.data == "x" * 10
