"""Incremental states in-process (fake engine; the directory store and a real redis-server the test run
starts): a turn stores the chunks its new tokens touched plus the metadata; slots with the same token prefix
share chunks; a restart restores from the chunks; a chunk lost or damaged is refused (``BAD_STATE``), never
restored wrong, and the resend rebuilds the slot.

The fake engine's KV records carry each cell's token id as its K and V rows (tests/orchestrator/fake_engine.py),
so a state assembled from wrong chunks restores other tokens, which the fake refuses."""

from __future__ import annotations

import asyncio

import pytest

from contract.errors import ErrorCode
from contract.protocol import KVRange
from orchestrator.engine_client.interface import EngineRequestError
from orchestrator.service_error import ServiceError
from orchestrator.slots.increments import READ_GROUP
from storage.base import SlotMeta
from tests.orchestrator.chunk_store import CHUNK, SYSTEM, Store, settled, turn
from tests.orchestrator.fake_engine import EOG
from tests.orchestrator.fake_world import World, greedy, saved

pytestmark = pytest.mark.asyncio


async def test_a_strict_commit_leaves_the_last_token_to_the_write_behind(store: Store) -> None:
    """The strict commit stores the tokens whose KV is in the cache: the last generated token's write
    (a decode step in the worker) is not waited for; the write-behind stores it soon after."""
    w = store.world()
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


async def test_a_turn_writes_the_chunks_its_tokens_touched(store: Store) -> None:
    w = store.world()
    await w.registry.start()
    try:
        await turn(w, "s", SYSTEM)  # 32 tokens: four full chunks
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.n_tokens == 32
        assert [(c.p0, c.p1) for c in meta.chunks] == [(0, 8), (8, 16), (16, 24), (24, 32)]
        first = await store.chunks()
        assert set(first) >= {c.key for c in meta.chunks}
        ids = [*SYSTEM, *greedy(SYSTEM, 2), 9, 10, 11]  # three new tokens, two generated
        await turn(w, "s", ids)
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.n_tokens == 37
        # the commit's range (all but the last token) and the write-behind's (that token)
        assert [(c.p0, c.p1) for c in meta.chunks][-2:] == [(32, 36), (36, 37)], "partial chunks for the new tokens"
        second = await store.chunks()
        assert set(second) - set(first) == {c.key for c in meta.chunks[-2:]}, "only the new chunks written"
        assert all(second[k] == first[k] for k in first), "old chunks untouched"
        # a truncation: the ranges after the cut are written again (their tokens differ)
        cut = [*SYSTEM[:20], 99, 98]
        await turn(w, "s", cut)
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*cut, *greedy(cut, 2)]
        assert [(c.p0, c.p1) for c in meta.chunks] == [(0, 8), (8, 16), (16, 24)]
        assert [c.key for c in meta.chunks[:2]] == [c.key for c in (await w.archive.lookup("s")).chunks[:2]]  # type: ignore[union-attr]
    finally:
        await w.registry.shutdown()


async def test_a_write_behind_turn_writes_only_its_chunk(store: Store) -> None:
    """The write-behind's save (which asks the store before it takes the slot's lock) is incremental too: after
    the first save, a turn writes one chunk of its new tokens, and a restart restores from the chunks."""
    w = store.world(strict=False)
    await w.registry.start()
    try:
        ids = [*SYSTEM, 1, 2]
        await w.gen("s", ids, n=2)
        await saved(w, "s")
        first = await store.chunks()
        ids = [*ids, *greedy(ids, 2), 3]
        await w.gen("s", ids, n=2)
        await saved(w, "s")
        second = await store.chunks()
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*ids, *greedy(ids, 2)]
        assert set(first) < set(second) and len(second) == len(first) + 1, "only the turn's chunk written"
    finally:
        await w.registry.shutdown()
    w2 = store.world(node="node-b", strict=False)
    await w2.registry.start()
    try:
        more = [*meta.tokens, 4]
        assert (await w2.gen("s", more, n=2)).n_cached == len(meta.tokens)
    finally:
        await w2.registry.shutdown()


async def settled_chunks(w: World, store: Store, *keys: str) -> list[SlotMeta]:
    """The stored metadata of slots ``keys`` once the store holds exactly the chunks they name: the last token's
    write-behind save is made now and waited for (scheduled, it could start after a first look found the store
    settled: seen 1 in 12 runs), then its chunks and metadata may still be landing; 10 s at most."""
    assert w.registry.durability is not None
    await w.registry.durability.flush(wait_for_locks=True)
    for k in keys:
        await w.archive.settled(k)
    for _ in range(200):
        metas = [await w.archive.lookup(k) for k in keys]
        named = {c.key for m in metas if m is not None for c in m.chunks}
        if all(m is not None for m in metas) and set(await store.chunks()) == named:
            break
        await asyncio.sleep(0.05)
    assert all(m is not None for m in metas)
    return [m for m in metas if m is not None]


async def test_a_system_prompt_shares_its_partial_chunk(store: Store) -> None:
    """Two conversations whose first message (a 29-token system prompt ending with the end-of-turn token,
    no multiple of the chunk size) is the same share its KV whole: [24, 29) is a range of its own in both
    manifests, also once their turns complete that chunk, and is stored once."""
    system = [*SYSTEM[:28], EOG]
    w = store.world()
    await w.registry.start()
    try:
        await turn(w, "a", [*system, 1, 2])
        await turn(w, "b", [*system, 3, 4, 5])
        for key, more in (("a", [6]), ("b", [7, 8, 9])):
            meta = await w.archive.lookup(key)
            assert meta is not None
            await turn(w, key, [*meta.tokens, *more])  # completes the chunk [24, 32)
        a, b = await settled_chunks(w, store, "a", "b")
        assert [(c.p0, c.p1) for c in a.chunks][:5] == [(0, 8), (8, 16), (16, 24), (24, 29), (29, 32)]
        shared = {c.key for c in a.chunks} & {c.key for c in b.chunks}
        assert shared == {c.key for c in a.chunks[:4]}, "all 29 positions of the system prompt stored once"
        assert len(await store.chunks()) == len({c.key for c in a.chunks} | {c.key for c in b.chunks})
    finally:
        await w.registry.shutdown()


async def test_same_prefix_shares_chunks_and_a_restart_restores_them(store: Store) -> None:
    w = store.world()
    await w.registry.start()
    try:
        await w.gen("a", [*SYSTEM, 1, 2], n=2)
        await w.gen("b", [*SYSTEM, 3, 4], n=2)
        a, b = await settled_chunks(w, store, "a", "b")
        shared = {c.key for c in a.chunks} & {c.key for c in b.chunks}
        assert len(shared) == 3, "the 24 positions of whole chunks before the slots differ are stored once"
        assert len(await store.chunks()) == len({c.key for c in a.chunks} | {c.key for c in b.chunks})
        want = list(a.tokens)
    finally:
        await w.registry.shutdown()
    # another process on the same store: the slot is restored from its chunks and continues from them
    w2 = store.world(node="node-b")
    await w2.registry.start()
    try:
        more = [*want, 5]
        done = await w2.gen("a", more, n=2)
        assert done.n_cached == len(want), "the restored state held every token"
        assert w2.seq_tokens("a") == [*more, *greedy(more, 2)]
    finally:
        await w2.registry.shutdown()


@pytest.mark.parametrize("damage", ["lost", "flipped", "swapped"])
async def test_a_lost_or_damaged_chunk_is_refused_and_the_resend_rebuilds(store: Store, damage: str) -> None:
    w = store.world()
    await w.registry.start()
    try:
        await w.gen("s", SYSTEM, n=2)
        await w.gen("t", [9, *SYSTEM[1:8], 77, *SYSTEM[9:]], n=2)  # another slot's chunks, to swap in
        meta = await w.archive.lookup("s")
        other = await w.archive.lookup("t")
        assert meta is not None and other is not None
    finally:
        await w.registry.shutdown()
    values = await store.chunks()
    victim = meta.chunks[1].key
    if damage == "lost":
        await store.overwrite(victim, None)
    elif damage == "flipped":
        data = bytearray(values[victim])
        data[-3] ^= 0x10
        await store.overwrite(victim, bytes(data))
    else:
        await store.overwrite(victim, values[other.chunks[1].key])  # sealed, whole, but other tokens
    w2 = store.world(node="node-b")
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
    # the rebuilt slot's stored state is whole: a damaged chunk under a key it names was written anew
    w3 = store.world(node="node-c")
    await w3.registry.start()
    try:
        more = [*stored.tokens, 5]
        done = await w3.gen("s", more, n=2)
        assert done.n_cached == len(stored.tokens), "restored from the store, every chunk sound"
        assert w3.seq_tokens("s") == [*more, *greedy(more, 2)]
    finally:
        await w3.registry.shutdown()


async def test_the_kv_records_read_for_a_save_are_handed_back(store: Store) -> None:
    """Each record ``read_kv`` returned goes back to the engine client once sealed (its receive buffer
    then serves the next read instead of being allocated afresh)."""
    w = store.world()
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


async def test_a_long_save_reads_in_groups_and_an_error_hands_every_record_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save reads its chunks :data:`READ_GROUP` ranges at a time (the next read in flight while the last
    is sealed); a read that fails midway fails the commit, commits nothing, and every record read before it
    (or in flight with it) goes back to the engine client; the next turn stores the whole state."""
    w = store.world()
    await w.registry.start()
    try:
        ids = [(11 * i) % 400 + 1 for i in range(8 * CHUNK - 3)]  # eight chunks once the turn is done
        engine, read_kv = w.engine, w.engine.read_kv
        groups: list[int] = []

        async def failing(seq: int, ranges: list[KVRange]) -> object:
            if ranges:
                groups.append(len(ranges))
                if len(groups) == 3:
                    raise EngineRequestError(ErrorCode.INTERNAL, "the worker failed a read")
            return await read_kv(seq, ranges)

        monkeypatch.setattr(engine, "read_kv", failing)
        with pytest.raises(EngineRequestError, match="failed a read"):
            await w.gen("s", ids, n=2)
        assert groups[:2] == [READ_GROUP, READ_GROUP], "read in groups"
        assert await w.archive.lookup("s") is None, "nothing committed"
        released = {id(b) for b in engine.released}
        assert engine.lent and all(id(r) in released for r in engine.lent), "a record was not handed back"

        monkeypatch.setattr(engine, "read_kv", read_kv)
        more = [*ids, *greedy(ids, 2), 5]
        await turn(w, "s", more)
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*more, *greedy(more, 2)]
        assert (meta.chunks[0].p0, meta.chunks[0].p1) == (0, CHUNK) and meta.chunks[-1].p1 == len(meta.tokens)
        assert all(id(r) in {id(b) for b in engine.released} for r in engine.lent)
    finally:
        await w.registry.shutdown()
