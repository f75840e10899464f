"""The store deadline (storage/timeouts.py) scales with the bytes a chunk call moves, and still cuts off
a call that takes longer than its deadline."""

from __future__ import annotations

import asyncio

import pytest

from storage.errors import StoreUnavailableError
from storage.timeouts import TimeoutStore


class SlowChunks:
    """A chunk store whose reads and writes take ``delay_s`` (a slow link moving a large state)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.got: list[tuple[list[str], int]] = []

    async def get_chunks(self, keys: list[str], nbytes: int = 0) -> list[bytes | None]:
        self.got.append((keys, nbytes))
        await asyncio.sleep(self.delay_s)
        return [b"v" for _ in keys]

    async def put_chunks(self, chunks: dict[str, bytes]) -> int:
        await asyncio.sleep(self.delay_s)
        return len(chunks)


@pytest.mark.asyncio
async def test_a_large_chunk_read_gets_a_deadline_scaled_by_its_bytes() -> None:
    inner = SlowChunks(0.3)
    store = TimeoutStore(inner, timeout_s=0.1, bytes_per_s=1e6)  # type: ignore[arg-type]
    # 0.5 MB at 1 MB/s: 0.1 + 0.5 s, enough for a 0.3 s read
    assert await store.get_chunks(["a", "b"], 500_000) == [b"v", b"v"]
    assert inner.got[-1] == (["a", "b"], 500_000), "the size reaches the store"
    with pytest.raises(StoreUnavailableError, match=r"get_chunks within 0\.1 s"):
        await store.get_chunks(["a"])  # size unknown: the plain deadline, which the read outlives
    with pytest.raises(StoreUnavailableError, match="get_chunks"):
        await store.get_chunks(["a"], 100_000)  # 0.2 s: a read that takes longer is still cut off


@pytest.mark.asyncio
async def test_a_large_chunk_write_gets_a_deadline_scaled_by_its_bytes() -> None:
    store = TimeoutStore(SlowChunks(0.3), timeout_s=0.1, bytes_per_s=1e6)  # type: ignore[arg-type]
    assert await store.put_chunks({"a": bytes(400_000)}) == 1
    with pytest.raises(StoreUnavailableError, match="put_chunks"):
        await store.put_chunks({"a": bytes(10)})
