"""The KV chunk store (storage.base.ChunkStore) of every store (directory, Redis, a three-master Redis Cluster,
Redis behind Sentinel; each server started by the test run): write-once chunks, touches, the sweep of chunks
no slot names, an incremental state's save (fenced by the lease) and load, and damage refused."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from slotstate import kv_chunks
from slotstate.ses1 import unpack_ses1
from storage import redis_chunks
from storage.base import ChunkRef, ChunkStore
from storage.directory import DirectoryStore
from storage.errors import BadStateError, LeaseLostError, StoreUnavailableError
from storage.redis_store import RedisStore
from storage.slot_codec import load_slot, save_chunks

if TYPE_CHECKING:
    from conftest import StoreHarness

pytestmark = pytest.mark.asyncio

RNG = np.random.default_rng(11)
KEYS = [f"{i:032x}" for i in range(1, 5)]


def record(p0: int, p1: int) -> bytes:
    """A one-layer f16 record of positions ``[p0, p1)``, rows of random bytes (V by rows)."""
    n = p1 - p0
    meta = b"".join(struct.pack("<iIi", p, 1, 0) for p in range(p0, p1))
    rows = RNG.integers(0, 256, (2, n * 8), dtype=np.uint8)
    return (
        struct.pack("<I", n)
        + meta
        + struct.pack("<II", 0, 1)
        + struct.pack("<iQ", 1, 8)
        + rows[0].tobytes()
        + struct.pack("<iQ", 1, 8)
        + rows[1].tobytes()
    )


def make(harness: StoreHarness) -> DirectoryStore | RedisStore:
    """A store of the harness's kind (both keep chunks)."""
    store = harness.make()
    assert isinstance(store, DirectoryStore | RedisStore) and isinstance(store, ChunkStore)
    return store


async def age(
    harness: StoreHarness, store: DirectoryStore | RedisStore, keys: list[str], seconds: float = 3600
) -> None:
    """Make the chunks ``keys`` look untouched for ``seconds`` (a file's mtime, a Redis chunk's ``t``)."""
    if isinstance(store, RedisStore):
        for key in keys:
            t = await harness.raw().hget(store.kv_chunk_key(key), "t")
            await harness.raw().hset(store.kv_chunk_key(key), "t", int(t or 0) - round(seconds * 1000))
        return
    assert isinstance(store, DirectoryStore)
    for key in keys:
        old = os.stat(store.chunks.path(key)).st_mtime - seconds
        os.utime(store.chunks.path(key), (old, old))


async def overwrite(harness: StoreHarness, store: DirectoryStore | RedisStore, key: str, value: bytes | None) -> None:
    """Replace chunk ``key``'s stored value behind the store's back (None: remove the chunk)."""
    if isinstance(store, RedisStore):
        if value is None:
            await harness.raw().delete(store.kv_chunk_key(key))
        else:
            await harness.raw().hset(store.kv_chunk_key(key), "v", value)
        return
    assert isinstance(store, DirectoryStore)
    if value is None:
        store.chunks.path(key).unlink()
    else:
        store.chunks.path(key).write_bytes(value)


async def stored_value(harness: StoreHarness, store: DirectoryStore | RedisStore, key: str) -> bytes:
    if isinstance(store, RedisStore):
        value = await harness.raw().hget(store.kv_chunk_key(key), "v")
        assert isinstance(value, bytes)
        return value
    assert isinstance(store, DirectoryStore)
    return store.chunks.path(key).read_bytes()


async def test_chunks_are_written_once_and_read_back(harness: StoreHarness) -> None:
    store = make(harness)
    assert await store.put_chunks({KEYS[0]: b"a" * 100, KEYS[1]: b"b" * 50}) == 150
    assert await store.put_chunks({KEYS[0]: b"c" * 100}) == 0, "present: only touched"
    assert await store.get_chunks([KEYS[0], KEYS[2], KEYS[1]]) == [b"a" * 100, None, b"b" * 50]
    assert await store.has_chunks([KEYS[1], KEYS[2]]) == [50, -1]
    assert await store.get_chunks([]) == [] and await store.has_chunks([]) == [] and await store.put_chunks({}) == 0
    for bad in ("../../etc/passwd", "ABCDEF" * 6, "0" * 31, "", "*" * 32):
        with pytest.raises(ValueError):
            await store.get_chunks([bad])
        with pytest.raises(ValueError):
            await store.has_chunks([KEYS[0], bad])
        with pytest.raises(ValueError):
            await store.put_chunks({bad: b"x"})
    assert await store.has_chunks([KEYS[2]]) == [-1], "a refused put wrote nothing"
    assert await store.list_meta() == [], "the chunks are not slots"
    other = make(harness)  # another node on the same store sees them
    assert await other.get_chunks([KEYS[1]]) == [b"b" * 50]


async def test_a_long_read_is_batched(harness: StoreHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """More chunks than one batch holds (as an 8,000-token restore has): every value back, in order."""
    monkeypatch.setattr(redis_chunks, "BATCH_BYTES", 1000)
    store = make(harness)
    values = {f"{i + 16:032x}": RNG.integers(0, 256, 300 + i, dtype=np.uint8).tobytes() for i in range(20)}
    assert await store.put_chunks(values) == sum(len(v) for v in values.values())
    keys = [*list(values)[::-1], "9" * 32]
    assert await store.get_chunks(keys) == [*(values[k] for k in keys[:-1]), None]
    assert await store.has_chunks(keys) == [*(len(values[k]) for k in keys[:-1]), -1]
    assert redis_chunks._batches([400, 400, 400, 2000, 10], 1000) == [
        range(0, 2),
        range(2, 3),
        range(3, 4),
        range(4, 5),
    ]


async def test_incremental_state_round_trip_fence_and_sweep(harness: StoreHarness) -> None:
    store = make(harness)
    tokens = RNG.integers(0, 1000, 20).tolist()
    ranges = [(0, 8), (8, 16), (16, 20)]
    keys = kv_chunks.chunk_keys(b"fp\0t\0", tokens, ranges)
    records = [record(p0, p1) for p0, p1 in ranges]
    new = {k: kv_chunks.seal(r, k) for k, r in zip(keys, records, strict=True)}
    chunks = [ChunkRef(p0, p1, k) for (p0, p1), k in zip(ranges, keys, strict=True)]
    lease = await store.acquire_lease("t/s", "node-a", 10_000)
    assert lease is not None
    meta, written = await save_chunks(store, "t/s", "fp", tokens, chunks, new, b"", codec="none", lease=lease)
    assert written == sum(len(v) for v in new.values()) and meta.chunks == chunks and meta.generation == 1
    got = await load_slot(make(harness), "t/s", "fp")  # another node reads it
    assert got is not None
    ses1 = unpack_ses1(got[1])
    assert ses1.tokens == tokens
    assert bytes(ses1.state) == bytes(kv_chunks.state_of([kv_chunks.join_records(records)]))
    # another node's lease: nothing committed
    with pytest.raises(LeaseLostError):
        await save_chunks(store, "t/s", "fp", tokens[:8], chunks[:1], {}, b"", codec="none", lease="other#1")
    assert (await store.get_meta("t/s")).generation == 1  # type: ignore[union-attr]
    # the sweep: an old chunk nobody names goes, the named ones and a fresh one stay
    orphan, fresh = "f" * 32, "e" * 32
    await store.put_chunks({orphan: b"x", fresh: b"y"})
    await age(harness, store, [*keys, orphan])
    assert await store.sweep_chunks(600) == 1
    assert [s >= 0 for s in await store.has_chunks([*keys, orphan, fresh])] == [True, True, True, False, True]
    # the slot deleted: its chunks go once untouched for the grace, not before
    assert await store.delete("t/s", lease=lease)
    assert await store.sweep_chunks(600) == 0
    await age(harness, store, keys)
    assert await make(harness).sweep_chunks(600) == 3
    assert await store.has_chunks(keys) == [-1, -1, -1]


async def test_a_touch_spares_a_chunk_from_a_sweep_on_another_node(harness: StoreHarness) -> None:
    """A commit in flight on node A (its chunks found or written, its manifest not stored yet) keeps them
    from node B's sweep, however old they were."""
    a, b = make(harness), make(harness)
    await a.put_chunks({KEYS[0]: b"old"})
    await age(harness, a, [KEYS[0]])
    assert await a.has_chunks([KEYS[0]]) == [3]  # node A's save finds it
    assert await b.sweep_chunks(600) == 0
    assert await b.get_chunks([KEYS[0]]) == [b"old"]


@pytest.mark.parametrize("damage", ["lost", "flipped", "swapped"])
async def test_a_damaged_chunk_is_refused(harness: StoreHarness, damage: str) -> None:
    store = make(harness)
    tokens = RNG.integers(0, 1000, 16).tolist()
    ranges = [(0, 8), (8, 16)]
    keys = kv_chunks.chunk_keys(b"fp\0t\0", tokens, ranges)
    new = {k: kv_chunks.seal(record(p0, p1), k) for k, (p0, p1) in zip(keys, ranges, strict=True)}
    chunks = [ChunkRef(p0, p1, k) for (p0, p1), k in zip(ranges, keys, strict=True)]
    await save_chunks(store, "t/d", "fp", tokens, chunks, new, b"", codec="none")
    if damage == "lost":
        await overwrite(harness, store, keys[1], None)
    elif damage == "flipped":
        value = bytearray(await stored_value(harness, store, keys[1]))
        value[-3] ^= 0x10
        await overwrite(harness, store, keys[1], bytes(value))
    else:  # sealed and whole, but another key's chunk
        await overwrite(harness, store, keys[1], await stored_value(harness, store, keys[0]))
    with pytest.raises(BadStateError, match="chunk"):
        await load_slot(store, "t/d", "fp")
    assert await store.has_chunks(keys) == [len(new[keys[0]]), -1], "a damaged chunk is removed, a sound one kept"
    assert await store.drop_chunks([keys[0], "9" * 32]) == 1


async def test_a_gap_in_the_manifest_is_refused(harness: StoreHarness) -> None:
    store = make(harness)
    tokens = RNG.integers(0, 1000, 16).tolist()
    keys = kv_chunks.chunk_keys(b"fp\0t\0", tokens, [(0, 8), (8, 16)])
    new = {keys[0]: kv_chunks.seal(record(0, 8), keys[0]), keys[1]: kv_chunks.seal(record(8, 16), keys[1])}
    gap = [ChunkRef(0, 8, keys[0]), ChunkRef(9, 16, keys[1])]
    await save_chunks(store, "t/g", "fp", tokens, gap, new, b"", codec="none")
    with pytest.raises(BadStateError, match="cover"):
        await load_slot(store, "t/g", "fp")


async def test_a_failed_chunk_write_raises_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory store writes a put's new chunks in parallel: one that fails makes the put raise
    StoreUnavailableError, leaves no ``.tmp-`` file, and the others are complete files or absent (never torn)."""
    store = DirectoryStore(str(tmp_path))
    replace = os.replace

    def failing(src: str, dst: Path) -> None:
        if str(dst).endswith(KEYS[2]):
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    values = {k: bytes([i]) * (1000 + i) for i, k in enumerate(KEYS)}
    with pytest.raises(StoreUnavailableError, match="No space"):
        await store.put_chunks(values)
    monkeypatch.setattr(os, "replace", replace)
    left = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert not [n for n in left if n.startswith(".tmp-")], left
    got = await store.get_chunks(KEYS)
    assert got[2] is None and all(g is None or g == values[k] for g, k in zip(got, KEYS, strict=True))
    assert await store.put_chunks(values) == sum(len(v) for k, v in values.items() if got[KEYS.index(k)] is None)
    assert await store.get_chunks(KEYS) == [values[k] for k in KEYS]
