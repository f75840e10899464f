"""The KV chunk store (storage.base.ChunkStore) of the directory store: write-once chunks, touches, the sweep of
chunks no slot names, an incremental state's save (fenced by the lease) and load.  Redis keeps no chunks yet:
its states are stored whole (docs/operations.md, "Incremental states")."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from slotstate import kv_chunks
from slotstate.ses1 import unpack_ses1
from storage.base import ChunkRef, ChunkStore
from storage.directory import DirectoryStore
from storage.errors import BadStateError, LeaseLostError
from storage.slot_codec import load_slot, save_chunks

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


async def test_chunks_are_written_once_and_read_back(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    assert isinstance(store, ChunkStore)
    assert await store.put_chunks({KEYS[0]: b"a" * 100, KEYS[1]: b"b" * 50}) == 150
    assert await store.put_chunks({KEYS[0]: b"c" * 100}) == 0, "present: only touched"
    assert await store.get_chunks([KEYS[0], KEYS[2], KEYS[1]]) == [b"a" * 100, None, b"b" * 50]
    assert await store.has_chunks([KEYS[1], KEYS[2]]) == [50, -1]
    for bad in ("../../etc/passwd", "ABCDEF" * 6, "0" * 31, ""):
        with pytest.raises(ValueError):
            await store.get_chunks([bad])
    assert await store.list_meta() == [], "the chunk folder is not a slot"


async def test_incremental_state_round_trip_fence_and_sweep(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
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
    got = await load_slot(store, "t/s", "fp")
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
    old = time.time() - 3600
    for key in [*keys, orphan]:
        os.utime(store.chunks.path(key), (old, old))
    assert await store.sweep_chunks(600) == 1
    assert [s >= 0 for s in await store.has_chunks([*keys, orphan, fresh])] == [True, True, True, False, True]
    # a chunk lost: refused
    store.chunks.path(keys[1]).unlink()
    with pytest.raises(BadStateError, match="missing"):
        await load_slot(store, "t/s", "fp")
