"""The store contract, run against every implementation: directory, Redis, a three-master Redis Cluster
and Redis behind Sentinel (each server started by the test run): a slot's record written, read, overwritten
(generations, chunks), expired, deleted and listed, by concurrent readers and writers, under any slot id.
Damaged states are in ``test_storage_integrity.py``, leases and fenced writes in ``test_storage_leases.py``."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

from storage.base import SlotMeta, SlotStore
from storage.directory import DirectoryStore
from storage.slot_codec import load_slot
from tests.storage.store_records import blob_for, meta_for
from tests.waiting import async_wait_until

if TYPE_CHECKING:
    from conftest import StoreHarness

pytestmark = pytest.mark.asyncio

RNG = np.random.default_rng(7)


async def test_round_trip(harness: StoreHarness) -> None:
    store = harness.make()
    blob = RNG.integers(0, 256, 12_345, dtype=np.uint8).tobytes()
    before = time.time()
    meta = SlotMeta(
        slot_id="chat-1",
        model_fingerprint="fp-A",
        n_tokens=3,
        tokens=[1, 2, 3],
        codec="zstd",
        level=5,
        raw_size=99_999,
        stored_size=0,
        created_at=0.0,
        updated_at=0.0,
    )
    stored = await store.put(meta, blob)
    assert stored.generation == 1 and stored.n_chunks == 1 and stored.stored_size == len(blob)
    assert before <= stored.created_at <= stored.updated_at <= time.time()
    got = await store.get("chat-1")
    assert got is not None
    got_meta, got_blob = got
    assert got_blob == blob
    assert got_meta == stored
    assert (
        got_meta.model_fingerprint,
        got_meta.tokens,
        got_meta.codec,
        got_meta.level,
        got_meta.raw_size,
    ) == (
        "fp-A",
        [1, 2, 3],
        "zstd",
        5,
        99_999,
    )
    assert await store.get_meta("chat-1") == stored
    other = harness.make()  # a second instance over the same data sees the same thing
    assert await other.get("chat-1") == (stored, blob)


async def test_absent_slot(harness: StoreHarness) -> None:
    store = harness.make()
    assert await store.get("nope") is None
    assert await store.get_meta("nope") is None
    assert await store.delete("nope") is False
    assert await store.list_meta() == []
    assert await load_slot(store, "nope", "fp-A") is None
    await store.ping()


async def test_overwrite_increments_generation_and_drops_old_chunks(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=1000)
    first = await store.put(meta_for("s", b"a" * 5000, 1), b"a" * 5000)
    second = await store.put(meta_for("s", b"b" * 2500, 2), b"b" * 2500)
    assert (first.generation, second.generation) == (1, 2)
    assert second.created_at == first.created_at
    assert second.updated_at >= first.updated_at
    assert await store.get("s") == (second, b"b" * 2500)
    third = await store.put(meta_for("s", b"c", 3), b"c")
    assert third.generation == 3
    if harness.is_redis:
        assert (first.n_chunks, second.n_chunks, third.n_chunks) == (5, 3, 1)
        assert await harness.artifacts(store, "s") == {"meta", "blob:3:0"}
    else:
        assert await harness.artifacts(store, "s") == {"slot.bin"}


async def test_created_at_from_caller_is_kept_for_new_slots(harness: StoreHarness) -> None:
    store = harness.make()
    meta = meta_for("imported", b"x")
    meta.created_at = 1_000_000.5
    stored = await store.put(meta, b"x")
    assert stored.created_at == 1_000_000.5
    assert (await store.get_meta("imported")).created_at == 1_000_000.5  # type: ignore[union-attr]


async def test_chunking_reassembles_exactly(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=1000)
    blob = RNG.integers(0, 256, 10_500, dtype=np.uint8).tobytes()
    stored = await store.put(meta_for("big", blob), blob)
    assert await store.get("big") == (stored, blob)
    if harness.is_redis:
        assert stored.n_chunks == 11
        assert await harness.artifacts(store, "big") == {"meta"} | {f"blob:1:{i}" for i in range(11)}
        raw = harness.raw()
        sizes = [len(await raw.get(store.chunk_key("big", 1, i))) for i in range(11)]  # type: ignore[attr-defined]
        assert sizes == [1000] * 10 + [500]
    else:
        assert stored.n_chunks == 1
    exact = RNG.integers(0, 256, 3000, dtype=np.uint8).tobytes()  # exact multiple of the chunk size
    stored = await store.put(meta_for("exact", exact), exact)
    assert await store.get("exact") == (stored, exact)
    assert stored.n_chunks == (3 if harness.is_redis else 1)
    stored = await store.put(meta_for("empty", b""), b"")
    assert await store.get("empty") == (stored, b"")


async def test_readers_never_see_a_mismatched_pair(harness: StoreHarness) -> None:
    writer = harness.make(chunk_size=1000)
    reader = harness.make(chunk_size=1000)
    await writer.put(meta_for("hot", blob_for(0), 0), blob_for(0))
    done = asyncio.Event()
    seen: list[int] = []

    async def write() -> None:
        for k in range(1, 41):
            await writer.put(meta_for("hot", blob_for(k), k), blob_for(k))
            await asyncio.sleep(0)
        done.set()

    async def read() -> None:
        while not done.is_set():
            got = await reader.get("hot")
            assert got is not None
            meta, blob = got
            k = meta.tokens[0]
            assert blob == blob_for(k), f"meta of write {k} paired with another blob"
            assert meta.stored_size == len(blob) and meta.generation == k + 1
            seen.append(k)

    await asyncio.gather(write(), read(), read(), read())
    assert len(set(seen)) >= 3, f"readers saw too few versions to prove anything: {sorted(set(seen))}"
    final = await reader.get("hot")
    assert final is not None and final[0].tokens == [40] and final[1] == blob_for(40)


async def test_concurrent_writers_each_get_a_generation(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=1000)

    async def write(offset: int) -> list[int]:
        gens = []
        for k in range(offset, offset + 15):
            gens.append((await store.put(meta_for("w", blob_for(k), k), blob_for(k))).generation)
        return gens

    a, b = await asyncio.gather(write(0), write(100))
    assert sorted(a + b) == list(range(1, 31))
    meta, blob = await store.get("w")  # type: ignore[misc]
    assert meta.generation == 30 and blob == blob_for(meta.tokens[0])
    if harness.is_redis:
        assert await harness.artifacts(harness.make(), "w") == {"meta"} | {f"blob:30:{i}" for i in range(meta.n_chunks)}


async def absent(store: SlotStore, slot_id: str) -> bool:
    return await store.get_meta(slot_id) is None


async def test_ttl_expiry_and_refresh(harness: StoreHarness) -> None:
    store, lasting = harness.make(ttl_s=0.8), harness.make(ttl_s=3600)  # one data set, two TTLs
    await store.put(meta_for("t", b"x", 1), b"x")
    await store.put(meta_for("keep", b"y", 1), b"y")
    await lasting.put(meta_for("t", b"x2", 2), b"x2")  # a later save sets the TTL of "t" anew, "keep"'s stays
    await async_wait_until(lambda: absent(store, "keep"), '"keep" expires')
    assert await store.get("keep") is None
    got = await store.get("t")
    assert got is not None and got[1] == b"x2", "the second save refreshed the TTL of t"
    assert [m.slot_id for m in await store.list_meta()] == ["t"]
    await store.put(meta_for("t", b"x3", 3), b"x3")
    await async_wait_until(lambda: absent(store, "t"), '"t" expires')
    assert await store.get("t") is None
    assert await store.list_meta() == []
    if isinstance(store, DirectoryStore):
        assert await store.purge_expired() == 2
        assert not any(store.dir.iterdir())
    else:
        assert await harness.artifacts(store, "t") == set()


async def test_delete(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=1000)
    await store.put(meta_for("d", b"z" * 4500), b"z" * 4500)
    await store.put(meta_for("other", b"o"), b"o")
    assert await store.delete("d") is True
    assert await store.get("d") is None
    assert await store.get_meta("d") is None
    assert await store.delete("d") is False
    assert await harness.artifacts(store, "d") == set()
    assert await store.get("other") is not None
    again = await store.put(meta_for("d", b"new"), b"new")
    assert await store.get("d") == (again, b"new")


async def test_list_meta_and_prefix_isolation(harness: StoreHarness) -> None:
    store = harness.make()
    for sid in ("0", "1", "chat/2"):
        await store.put(meta_for(sid, sid.encode()), sid.encode())
    metas = await store.list_meta()
    assert sorted(m.slot_id for m in metas) == ["0", "1", "chat/2"]
    assert all(m.generation == 1 for m in metas)
    await store.delete("1")
    assert sorted(m.slot_id for m in await store.list_meta()) == ["0", "chat/2"]
    harness.prefix = harness.prefix[:-1] + "-other:"
    other = harness.make()
    assert await other.list_meta() == []
    assert await other.get("0") is None


ODD_IDS = [
    "a/b",
    "..",
    ".",
    "../escape",
    "../../etc/passwd",
    "/abs",
    "ünïcödé-🙂",
    "{tag}",
    "}x{",
    "%7D",
    "a}:meta",
    "with space",
    "CaSe",
    "case",
    "0",
    "x" * 600,
    "\x00nul",
]


async def test_odd_slot_ids_are_opaque(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=1000)
    for i, sid in enumerate(ODD_IDS):
        await store.put(meta_for(sid, blob_for(i), i), blob_for(i))
    for i, sid in enumerate(ODD_IDS):
        got = await store.get(sid)
        assert got is not None and got[0].slot_id == sid and got[1] == blob_for(i)
    assert sorted(m.slot_id for m in await store.list_meta()) == sorted(ODD_IDS)
    if isinstance(store, DirectoryStore):
        assert os.listdir(harness.tmp_path) == ["store"]
        root = harness.root.resolve()
        for dirpath, _, files in os.walk(root):
            assert os.path.realpath(dirpath).startswith(str(root))
            assert files == ["slot.bin"] or not files
    for sid in ODD_IDS:
        assert await store.delete(sid) is True
    assert await store.list_meta() == []


async def test_invalid_slot_ids(harness: StoreHarness) -> None:
    store = harness.make()
    with pytest.raises(ValueError, match="empty"):
        await store.put(meta_for("", b"x"), b"x")
    with pytest.raises(ValueError, match="UTF-8"):
        await store.get("\ud800")
    with pytest.raises(ValueError, match="long"):
        await store.get("x" * 2000)
    with pytest.raises(TypeError):
        await store.get(0)  # type: ignore[arg-type]


async def test_a_put_commits_only_once_ready_is_done(harness: StoreHarness) -> None:
    """``put(..., ready=...)``: the store may prepare the new version while ``ready`` runs (what a save's chunk
    writes are), but readers see the old version until ``ready`` is done; a ``ready`` that raises commits
    nothing, leaves nothing behind and its exception reaches the caller."""
    store = harness.make(chunk_size=1000)
    old = await store.put(meta_for("s", b"a" * 2500, 1), b"a" * 2500)
    release = asyncio.Event()
    started = asyncio.Event()

    async def chunks_written() -> None:
        started.set()
        await release.wait()

    new_blob = b"b" * 3500
    put = asyncio.ensure_future(store.put(meta_for("s", new_blob, 2), new_blob, ready=chunks_written()))
    await asyncio.wait_for(started.wait(), 5)
    for _ in range(20):  # the store prepares meanwhile; nothing is committed while ready runs
        await asyncio.sleep(0.01)
        assert await store.get("s") == (old, b"a" * 2500)
    assert not put.done()
    release.set()
    new = await asyncio.wait_for(put, 5)
    assert new.generation == old.generation + 1
    assert await store.get("s") == (new, new_blob)

    class ChunkWriteFailed(RuntimeError):
        pass

    async def failing() -> None:
        await asyncio.sleep(0.02)
        raise ChunkWriteFailed("a chunk write failed")

    with pytest.raises(ChunkWriteFailed):
        await store.put(meta_for("s", b"c" * 1500, 3), b"c" * 1500, ready=failing())
    assert await store.get("s") == (new, new_blob), "nothing committed"
    want = {"meta", f"blob:{new.generation}:0", f"blob:{new.generation}:1", f"blob:{new.generation}:2",
            f"blob:{new.generation}:3"} if harness.is_redis else {"slot.bin"}  # fmt: skip
    assert await harness.artifacts(store, "s") == want, "a prepared version left behind"
