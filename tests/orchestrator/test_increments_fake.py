"""Incremental states in-process (fake engine, directory store): a turn stores the chunks its new tokens
touched plus the metadata; slots with the same token prefix share chunks; a restart restores from the chunks;
a chunk lost or damaged is refused (``BAD_STATE``), never restored wrong, and the resend rebuilds the slot.

The fake engine's KV records carry each cell's token id as its K and V rows (tests/orchestrator/fake_engine.py),
so a state assembled from wrong chunks restores other tokens, which the fake refuses."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.service_error import ServiceError
from storage.base import SlotMeta
from tests.orchestrator.fake_engine import EOG
from tests.orchestrator.fake_world import World, greedy

pytestmark = pytest.mark.asyncio

CHUNK = 8  # positions per chunk in these tests (the default, 256, would make every test one chunk)
SYSTEM = [(7 * i) % 500 + 1 for i in range(30)]  # a "system prompt" of 30 tokens


def world(root: Path, **kw: object) -> World:
    w = World(root, strict=True, **kw)  # type: ignore[arg-type]
    assert w.registry.durability is not None
    w.registry.durability.increments.chunk_tokens = CHUNK
    return w


async def turn(w: World, slot: str, ids: list[int], n: int = 2) -> None:
    """One strict turn, then its write-behind save of the last generated token (whose KV write the
    strict commit does not wait for: :func:`test_a_strict_commit_leaves_the_last_token_to_the_write_behind`)."""
    await w.gen(slot, ids, n=n)
    assert w.registry.durability is not None
    await w.registry.durability.flush(wait_for_locks=True)


async def settled(w: World, slot: str, n_tokens: int) -> SlotMeta | None:
    """The stored metadata of ``slot`` once it holds ``n_tokens`` tokens (or after 2 s: as it is then)."""
    for _ in range(200):
        meta = await w.archive.lookup(slot)
        if meta is not None and meta.n_tokens == n_tokens:
            break
        await asyncio.sleep(0.01)
    return meta


def chunk_files(root: Path) -> dict[str, Path]:
    return {p.name: p for p in root.rglob("chunks/*/*") if not p.name.startswith(".tmp-")}


async def test_a_strict_commit_leaves_the_last_token_to_the_write_behind(tmp_path: Path) -> None:
    """The strict commit stores the tokens whose KV is in the cache: the last generated token's write
    (a decode step in the worker) is not waited for; the write-behind stores it soon after."""
    w = world(tmp_path / "state")
    await w.registry.start()
    try:
        await w.gen("s", SYSTEM, n=2)
        want = [*SYSTEM, *greedy(SYSTEM, 2)]
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == want[:-1], "answered once all but the last token were stored"
        assert w.registry.slots["s"].n_tokens == len(want), "the slot still counts its pending token"
        meta = await settled(w, "s", len(want))
        assert meta is not None and meta.tokens == want, "the write-behind stored the last token"
        assert [(c.p0, c.p1) for c in meta.chunks][-2:] == [(16, 24), (24, 32)], "[24, 31) completed by it"
        assert not w.registry.slots["s"].dirty
    finally:
        await w.registry.shutdown()


async def test_a_turn_writes_the_chunks_its_tokens_touched(tmp_path: Path) -> None:
    w = world(tmp_path / "state")
    await w.registry.start()
    try:
        await turn(w, "s", SYSTEM)  # 32 tokens: four full chunks
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.n_tokens == 32
        assert [(c.p0, c.p1) for c in meta.chunks] == [(0, 8), (8, 16), (16, 24), (24, 32)]
        first = chunk_files(tmp_path)
        assert set(first) >= {c.key for c in meta.chunks}
        ids = [*SYSTEM, *greedy(SYSTEM, 2), 9, 10, 11]  # three new tokens, two generated
        await turn(w, "s", ids)
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.n_tokens == 37
        # the commit's range (all but the last token) and the write-behind's (that token)
        assert [(c.p0, c.p1) for c in meta.chunks][-2:] == [(32, 36), (36, 37)], "partial chunks for the new tokens"
        second = chunk_files(tmp_path)
        assert set(second) - set(first) == {c.key for c in meta.chunks[-2:]}, "only the new chunks written"
        assert all(second[k].read_bytes() == first[k].read_bytes() for k in first), "old chunks untouched"
        # a truncation: the ranges after the cut are written again (their tokens differ)
        cut = [*SYSTEM[:20], 99, 98]
        await turn(w, "s", cut)
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*cut, *greedy(cut, 2)]
        assert [(c.p0, c.p1) for c in meta.chunks] == [(0, 8), (8, 16), (16, 24)]
        assert [c.key for c in meta.chunks[:2]] == [c.key for c in (await w.archive.lookup("s")).chunks[:2]]  # type: ignore[union-attr]
    finally:
        await w.registry.shutdown()


async def test_a_system_prompt_shares_its_partial_chunk(tmp_path: Path) -> None:
    """Two conversations whose first message (a 29-token system prompt ending with the end-of-turn token,
    no multiple of the chunk size) is the same share its KV whole: [24, 29) is a range of its own in both
    manifests, also once their turns complete that chunk, and is stored once."""
    system = [*SYSTEM[:28], EOG]
    w = world(tmp_path / "state")
    await w.registry.start()
    try:
        await turn(w, "a", [*system, 1, 2])
        await turn(w, "b", [*system, 3, 4, 5])
        for key, more in (("a", [6]), ("b", [7, 8, 9])):
            meta = await w.archive.lookup(key)
            assert meta is not None
            await turn(w, key, [*meta.tokens, *more])  # completes the chunk [24, 32)
        a, b = await w.archive.lookup("a"), await w.archive.lookup("b")
        assert a is not None and b is not None
        assert [(c.p0, c.p1) for c in a.chunks][:5] == [(0, 8), (8, 16), (16, 24), (24, 29), (29, 32)]
        shared = {c.key for c in a.chunks} & {c.key for c in b.chunks}
        assert shared == {c.key for c in a.chunks[:4]}, "all 29 positions of the system prompt stored once"
        assert len(chunk_files(tmp_path)) == len({c.key for c in a.chunks} | {c.key for c in b.chunks})
    finally:
        await w.registry.shutdown()


async def test_same_prefix_shares_chunks_and_a_restart_restores_them(tmp_path: Path) -> None:
    w = world(tmp_path / "state")
    await w.registry.start()
    try:
        await w.gen("a", [*SYSTEM, 1, 2], n=2)
        await w.gen("b", [*SYSTEM, 3, 4], n=2)
        a, b = await w.archive.lookup("a"), await w.archive.lookup("b")
        assert a is not None and b is not None
        shared = {c.key for c in a.chunks} & {c.key for c in b.chunks}
        assert len(shared) == 3, "the 24 positions of whole chunks before the slots differ are stored once"
        assert len(chunk_files(tmp_path)) == len({c.key for c in a.chunks} | {c.key for c in b.chunks})
        want = list(a.tokens)
    finally:
        await w.registry.shutdown()
    # another process on the same store: the slot is restored from its chunks and continues from them
    w2 = world(tmp_path / "state", node="node-b")
    await w2.registry.start()
    try:
        more = [*want, 5]
        done = await w2.gen("a", more, n=2)
        assert done.n_cached == len(want), "the restored state held every token"
        assert w2.seq_tokens("a") == [*more, *greedy(more, 2)]
    finally:
        await w2.registry.shutdown()


@pytest.mark.parametrize("damage", ["lost", "flipped", "swapped"])
async def test_a_lost_or_damaged_chunk_is_refused_and_the_resend_rebuilds(tmp_path: Path, damage: str) -> None:
    w = world(tmp_path / "state")
    await w.registry.start()
    try:
        await w.gen("s", SYSTEM, n=2)
        await w.gen("t", [9, *SYSTEM[1:8], 77, *SYSTEM[9:]], n=2)  # another slot's chunks, to swap in
        meta = await w.archive.lookup("s")
        other = await w.archive.lookup("t")
        assert meta is not None and other is not None
    finally:
        await w.registry.shutdown()
    files = chunk_files(tmp_path)
    victim = files[meta.chunks[1].key]
    if damage == "lost":
        victim.unlink()
    elif damage == "flipped":
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x10
        victim.write_bytes(bytes(data))
    else:
        victim.write_bytes(files[other.chunks[1].key].read_bytes())  # sealed, whole, but other tokens
    w2 = world(tmp_path / "state", node="node-b")
    await w2.registry.start()
    try:
        ids = [*meta.tokens, 4]
        with pytest.raises(ServiceError) as refused:
            await w2.gen("s", ids, n=2)
        assert refused.value.code == "BAD_STATE"
        assert "chunk" in refused.value.message
        done = await w2.gen("s", ids, n=2)  # the client resends: prefilled from nothing
        assert done.n_cached == 0
        assert w2.seq_tokens("s") == [*ids, *greedy(ids, 2)]
        stored = await settled(w2, "s", len(ids) + 2)
        assert stored is not None and stored.tokens == [*ids, *greedy(ids, 2)], "the rebuilt slot is stored"
    finally:
        await w2.registry.shutdown()


async def test_the_kv_records_read_for_a_save_are_handed_back(tmp_path: Path) -> None:
    """Each record ``read_kv`` returned goes back to the engine client once sealed (its receive buffer
    then serves the next read instead of being allocated afresh)."""
    w = world(tmp_path / "state")
    await w.registry.start()
    try:
        await w.gen("s", SYSTEM, n=2)
        await w.gen("s", [*SYSTEM, *greedy(SYSTEM, 2), 9, 10, 11], n=2)
        lent = w.engine.lent
        assert len(lent) >= 5, "both turns read records"
        released = {id(b) for b in w.engine.released}
        assert all(id(r) in released for r in lent), "a record was not handed back"
    finally:
        await w.registry.shutdown()
