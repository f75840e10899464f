"""Small records beside the slots (:mod:`storage.records`) in every store kind: written whole,
read back, replaced, absent when never written or past the store's TTL, bad names refused."""

from __future__ import annotations

import asyncio

import pytest

from storage.records import get_record, put_record
from storage.timeouts import TimeoutStore


@pytest.mark.asyncio
async def test_records_round_trip_in_every_store(harness) -> None:  # type: ignore[no-untyped-def]
    store = harness.make()
    assert await get_record(store, "response:alice/r1") is None
    await put_record(store, "response:alice/r1", b"first")
    await put_record(store, "response:bob/r1", b"bob's")
    assert await get_record(store, "response:alice/r1") == b"first"
    await put_record(store, "response:alice/r1", b"second, longer")
    assert await get_record(store, "response:alice/r1") == b"second, longer"
    assert await get_record(store, "response:bob/r1") == b"bob's", "names never meet"
    assert await get_record(TimeoutStore(store, 3.0), "response:bob/r1") == b"bob's", "through the deadline wrapper"
    for bad in ("", "x" * 1025):
        with pytest.raises(ValueError):
            await put_record(store, bad, b"x")
    with pytest.raises(ValueError):
        await put_record(store, "big", bytes(16 * 1024 * 1024 + 1))


@pytest.mark.asyncio
async def test_a_record_expires_with_the_stores_ttl(harness) -> None:  # type: ignore[no-untyped-def]
    store = harness.make(ttl_s=1.0)
    await put_record(store, "response:alice/short", b"gone soon")
    assert await get_record(store, "response:alice/short") == b"gone soon"
    await asyncio.sleep(1.3)
    assert await get_record(store, "response:alice/short") is None
