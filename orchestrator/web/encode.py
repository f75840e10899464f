"""Stream events encoded off the event loop when they are large.

A token event with attention carries the attention base64-encoded: 2.7 MB of JSON for the default model
at 2,000 tokens of context (``float32[30, 9, 2000]``).  Building and encoding it takes milliseconds, long
enough to hold up every other client on the one asyncio loop, so an event whose payload is at least
:data:`OFFLOAD_BYTES` is built and encoded in a worker thread (``asyncio.to_thread``); small ones, where a
thread hop would cost more than the work, are encoded in place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

OFFLOAD_BYTES = 64 << 10
"""Payload size (bytes of attention or hidden state) from which an event is built and encoded in a thread."""


def _encode(build: Callable[[], msgspec.Struct]) -> bytes:
    return msgspec.json.encode(build())  # the module function: thread-safe, unlike a shared Encoder


async def encoded(build: Callable[[], msgspec.Struct], payload_bytes: int) -> bytes:
    """``build()`` encoded as JSON by msgspec; in a worker thread when ``payload_bytes`` (the raw bytes the
    event will carry base64-encoded) is at least :data:`OFFLOAD_BYTES`."""
    if payload_bytes < OFFLOAD_BYTES:
        return _encode(build)
    return await asyncio.to_thread(_encode, build)


async def encoded_text(build: Callable[[], msgspec.Struct], payload_bytes: int) -> str:
    """:func:`encoded` as a ``str`` (a WebSocket text frame), decoded in the same thread."""
    if payload_bytes < OFFLOAD_BYTES:
        return _encode(build).decode()
    return await asyncio.to_thread(lambda: _encode(build).decode())
