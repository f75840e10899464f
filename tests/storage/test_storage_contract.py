"""The store contract, run against every implementation: directory, Redis, a three-master Redis Cluster
and Redis behind Sentinel (each server started by the test run)."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest

from slotstate.ses1 import pack_ses1
from storage.base import SlotMeta, SlotStore
from storage.directory import DirectoryStore
from storage.errors import BadStateError, FingerprintMismatchError, LeaseLostError
from storage.slot_codec import load_slot, save_slot
from tests.waiting import async_wait_until

if TYPE_CHECKING:
    from conftest import StoreHarness

pytestmark = pytest.mark.asyncio

RNG = np.random.default_rng(7)


def meta_for(slot_id: str, blob: bytes, k: int = 0, fingerprint: str = "fp-A") -> SlotMeta:
    """Meta for a raw test blob; ``k`` (stored as the only token) identifies the blob's content."""
    return SlotMeta(
        slot_id=slot_id,
        model_fingerprint=fingerprint,
        n_tokens=1,
        tokens=[k],
        codec="none",
        level=0,
        raw_size=len(blob),
        stored_size=len(blob),
        created_at=0.0,
        updated_at=0.0,
    )


def blob_for(k: int) -> bytes:
    """Content that encodes ``k`` everywhere, with a size that varies with ``k`` (3000..7900 bytes)."""
    size = 3000 + (k * 700) % 5000
    return (struct.pack("<Q", k) * (size // 8 + 1))[:size]


def ses1_state(n_tokens: int = 40, kv_values: int = 20_000) -> tuple[list[int], bytes]:
    tokens = RNG.integers(0, 50_000, n_tokens).tolist()
    state = RNG.normal(0, 1, kv_values).astype(np.float16).tobytes()
    return tokens, pack_ses1(tokens, state)


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


async def test_save_and_load_slot(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=4096)
    tokens, ses1 = ses1_state()
    for codec_name in ("auto", "best", "none", "zstd", "zstd-planes"):
        meta = await save_slot(store, "s", "fp-A", tokens, ses1, codec=codec_name, level=1)
        assert meta.codec in ("none", "zstd", "zstd-planes")
        assert meta.raw_size == len(ses1) and meta.tokens == tokens and meta.n_tokens == len(tokens)
        loaded = await load_slot(store, "s", "fp-A")
        assert loaded is not None
        assert loaded[1] == ses1
        assert loaded[0] == meta
    with pytest.raises(BadStateError, match="tokens differ"):
        await save_slot(store, "s", "fp-A", tokens[:-1], ses1)


async def test_load_slot_refuses_other_fingerprint(harness: StoreHarness) -> None:
    store = harness.make()
    tokens, ses1 = ses1_state()
    await save_slot(store, "s", "fp-A", tokens, ses1)
    with pytest.raises(FingerprintMismatchError) as info:
        await load_slot(store, "s", "fp-B")
    assert isinstance(info.value, BadStateError)
    assert (info.value.expected, info.value.found) == ("fp-B", "fp-A")
    loaded = await load_slot(store, "s", "fp-A")  # the refusal changed nothing
    assert loaded is not None and loaded[1] == ses1


async def test_flipped_bytes_in_stored_blob(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=2000)
    tokens, ses1 = ses1_state()
    meta = await save_slot(store, "s", "fp-A", tokens, ses1, codec="zstd-planes")
    assert meta.stored_size > 4000

    def flip(blob: bytes) -> bytes:
        damaged = bytearray(blob)
        for pos in (len(blob) // 2, len(blob) // 2 + 1, len(blob) - 5):
            damaged[pos] ^= 0x5A
        return bytes(damaged)

    await harness.mutate_blob(store, "s", flip)
    got = await store.get("s")  # the store itself cannot tell: same length
    assert got is not None and got[1] != b""
    with pytest.raises(BadStateError):
        await load_slot(store, "s", "fp-A")


async def test_truncated_stored_blob(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=2000)
    tokens, ses1 = ses1_state()
    await save_slot(store, "s", "fp-A", tokens, ses1, codec="zstd")
    await harness.mutate_blob(store, "s", lambda blob: blob[:-7])
    with pytest.raises(BadStateError):
        await store.get("s")
    with pytest.raises(BadStateError):
        await load_slot(store, "s", "fp-A")


async def test_tokens_in_state_must_match_meta(harness: StoreHarness) -> None:
    store = harness.make()
    tokens, ses1 = ses1_state()
    meta = meta_for("s", ses1)
    meta.tokens, meta.n_tokens = [*tokens[:-1], tokens[-1] + 1], len(tokens)
    await store.put(meta, ses1)
    with pytest.raises(BadStateError, match="tokens differ"):
        await load_slot(store, "s", "fp-A")


async def test_missing_chunk_is_bad_state(harness: StoreHarness) -> None:
    if not harness.is_redis:
        pytest.skip("only Redis splits blobs into chunk keys")
    store = harness.make(chunk_size=1000)
    stored = await store.put(meta_for("s", b"q" * 3500), b"q" * 3500)
    await harness.raw().delete(store.chunk_key("s", stored.generation, 2))  # type: ignore[attr-defined]
    with pytest.raises(BadStateError, match=r"chunks \[2\] missing"):
        await store.get("s")


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


async def no_owner(store: SlotStore, slot_id: str) -> bool:
    return await store.lease_owner(slot_id) is None


async def test_leases(harness: StoreHarness) -> None:
    node_a, node_b = harness.make(), harness.make()
    token_a = await node_a.acquire_lease("s", "node#A", 5000)
    assert token_a is not None
    assert await node_b.lease_owner("s") == "node#A"
    assert await node_b.acquire_lease("s", "node-B", 5000) is None
    assert await node_a.acquire_lease("s", "node#A", 5000) == token_a  # re-entrant for the same owner
    assert await node_b.renew_lease("s", "node#A#forged", 5000) is False
    assert await node_b.release_lease("s", "node-B#00") is False
    assert await node_a.renew_lease("s", token_a, 5000) is True
    assert await node_a.release_lease("s", token_a) is True
    assert await node_a.lease_owner("s") is None
    assert await node_a.release_lease("s", token_a) is False
    token_b = await node_b.acquire_lease("s", "node-B", 1000)
    assert token_b is not None and token_b != token_a
    assert await node_a.lease_owner("s") == "node-B"
    assert await node_a.acquire_lease("other-slot", "node#A", 5000) is not None  # leases are per slot
    await async_wait_until(lambda: no_owner(node_a, "s"), "node-B's lease expires")
    assert await node_b.renew_lease("s", token_b, 5000) is False
    assert await node_a.acquire_lease("s", "node#A", 5000) is not None
    with pytest.raises(ValueError):
        await node_a.acquire_lease("s", "node#A", 0)


@pytest.mark.parametrize("codec_name", ["none", "zstd", "zstd-planes"])
@pytest.mark.parametrize("n_flips", [1, 100])
async def test_bit_flips_in_the_stored_state_are_bad_state(
    harness: StoreHarness, codec_name: str, n_flips: int
) -> None:
    """Flipped bits anywhere in the stored blob are refused, for every codec ("none" has no checksum of its
    own: the metadata's digest catches it); the refusal changes nothing stored."""
    store = harness.make(chunk_size=2000)
    tokens, ses1 = ses1_state()
    meta = await save_slot(store, "s", "fp-A", tokens, ses1, codec=codec_name)
    assert meta.digest.startswith("xxh3-128:") and len(meta.digest) == len("xxh3-128:") + 32
    rng = np.random.default_rng(n_flips)
    # "none": only the KV part (after the SES1 header and the tokens), where nothing else checks.
    first = 8 + 4 * len(tokens) if codec_name == "none" else 0
    positions = rng.choice(np.arange(first, meta.stored_size), size=n_flips, replace=False)
    bits = rng.integers(0, 8, n_flips)

    def flip(blob: bytes) -> bytes:
        damaged = bytearray(blob)
        for pos, bit in zip(positions, bits, strict=True):
            damaged[int(pos)] ^= 1 << int(bit)
        return bytes(damaged)

    before = await store.get("s")
    await harness.mutate_blob(store, "s", flip)
    with pytest.raises(BadStateError):
        await load_slot(store, "s", "fp-A")
    after = await store.get("s")
    assert before is not None and after is not None and after[0] == before[0]  # meta untouched


async def test_meta_without_digest_still_loads(harness: StoreHarness) -> None:
    """States stored before the digest existed (``digest`` empty) load unchecked."""
    store = harness.make()
    tokens, ses1 = ses1_state()
    meta = meta_for("s", ses1)
    meta.tokens, meta.n_tokens = tokens, len(tokens)
    assert meta.digest == ""
    await store.put(meta, ses1)
    loaded = await load_slot(store, "s", "fp-A")
    assert loaded is not None and loaded[1] == ses1


async def test_writes_fenced_by_a_lease_commit_only_for_its_holder(harness: StoreHarness) -> None:
    """A put or delete with ``lease=token`` commits only while that token holds the slot's lease,
    checked in the same atomic step; a refused one leaves everything as it was (no temporary data)."""
    node_a, node_b = harness.make(chunk_size=1000), harness.make(chunk_size=1000)
    token_a = await node_a.acquire_lease("f", "node-a", 300)
    assert token_a is not None
    first = await node_a.put(meta_for("f", blob_for(1), 1), blob_for(1), lease=token_a)
    with pytest.raises(LeaseLostError):  # a token that never held the lease
        await node_b.put(meta_for("f", blob_for(2), 2), blob_for(2), lease="node-b#" + "0" * 32)
    await asyncio.sleep(0.4)  # node a "pauses" past its lease
    token_b = await node_b.acquire_lease("f", "node-b", 5000)
    assert token_b is not None
    second = await node_b.put(meta_for("f", blob_for(3), 3), blob_for(3), lease=token_b)
    assert second.generation == first.generation + 1
    with pytest.raises(LeaseLostError):  # node a wakes up and writes its stale state
        await node_a.put(meta_for("f", blob_for(4), 4), blob_for(4), lease=token_a)
    with pytest.raises(LeaseLostError):
        await node_a.delete("f", lease=token_a)
    assert await node_a.get("f") == (second, blob_for(3)), "the stale writer changed nothing"
    if harness.is_redis:
        assert await harness.artifacts(node_a, "f") == {"meta"} | {f"blob:2:{i}" for i in range(second.n_chunks)}
    assert await node_b.release_lease("f", token_b)
    with pytest.raises(LeaseLostError):  # no lease at all: not the holder either
        await node_b.put(meta_for("f", blob_for(5), 5), blob_for(5), lease=token_b)
    unfenced = await node_a.put(meta_for("f", blob_for(6), 6), blob_for(6))  # no lease given: unfenced
    assert unfenced.generation == second.generation + 1
    token_b = await node_b.acquire_lease("f", "node-b", 5000)
    assert token_b is not None and await node_b.delete("f", lease=token_b) is True
    assert await node_b.get("f") is None
