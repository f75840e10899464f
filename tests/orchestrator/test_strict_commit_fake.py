"""The strict commit's order of I/O with incremental states (fake engine; the directory store and a real
redis-server the test run starts): a turn's new chunks are read while the store is asked which it has, each group
is written while the next is read, the metadata's write is prepared while the chunks are written and committed
after them; a store failing at any of those steps fails the commit, commits nothing and hands every KV record
back to the engine client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from contract.errors import ErrorCode
from contract.protocol import KVRange
from orchestrator.service_error import ServiceError
from orchestrator.slots.increments import READ_GROUP
from storage.base import SlotMeta
from storage.errors import StoreUnavailableError
from tests.orchestrator.chunk_store import CHUNK, SYSTEM, Store, restores_elsewhere, signal_reads, turn
from tests.orchestrator.fake_world import greedy

pytestmark = pytest.mark.asyncio


async def test_a_strict_commit_writes_each_group_while_the_next_is_read(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that holds the slot's lock until its write (the strict commit) hands each sealed group of new chunks
    to the store at once, so the chunk writes overlap the next reads; each chunk's bytes go to the store once
    (the commit's own write then only names them); the state restores on another node."""
    w = store.world()
    await w.registry.start()
    events: list[str] = []
    try:
        ids = [(13 * i) % 400 + 1 for i in range(8 * CHUNK - 3)]  # eight chunks once the turn is done
        read_kv, put_chunks, store_put = w.engine.read_kv, w.archive.put_chunks, w.archive.store.put_chunks  # type: ignore[attr-defined]
        sent: list[str] = []

        async def reading(seq: int, ranges: list[KVRange]) -> object:
            if ranges:
                events.append("read")
            return await read_kv(seq, ranges)

        async def putting(chunks: dict[str, bytes]) -> int:
            events.append("put")
            return await put_chunks(chunks)

        async def counting(chunks: dict[str, bytes]) -> int:
            sent.extend(chunks)
            return await store_put(chunks)

        monkeypatch.setattr(w.engine, "read_kv", reading)
        monkeypatch.setattr(w.archive, "put_chunks", putting)
        monkeypatch.setattr(w.archive.store, "put_chunks", counting)
        await w.gen("s", ids, n=2)  # answered once committed
        meta = await w.archive.lookup("s")
        assert meta is not None and len(meta.chunks) == 8
        assert events.count("read") == 8 // READ_GROUP and events.count("put") == 8 // READ_GROUP
        assert events.index("put") < len(events) - 1 - events[::-1].index("read"), "a put before the last read"
        assert sorted(sent) == sorted(c.key for c in meta.chunks), "each chunk's bytes sent once"
        assert set(await store.chunks()) >= {c.key for c in meta.chunks}
    finally:
        await w.registry.shutdown()
    await restores_elsewhere(store, "s", list(meta.tokens))


async def test_a_store_failing_a_write_ahead_fails_the_commit_and_hands_records_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk write that fails during a strict commit's reads answers ``STORE_UNAVAILABLE``, commits nothing and
    hands every record back; once the store answers again the next turn stores the whole state."""
    w = store.world()
    await w.registry.start()
    try:
        ids = [(17 * i) % 400 + 1 for i in range(8 * CHUNK - 3)]
        store_put = w.archive.store.put_chunks  # type: ignore[attr-defined]
        calls: list[int] = []

        async def failing(chunks: dict[str, bytes]) -> int:
            calls.append(len(chunks))
            if len(calls) == 2:
                raise StoreUnavailableError("the test's store failed a chunk write")
            return await store_put(chunks)

        monkeypatch.setattr(w.archive.store, "put_chunks", failing)
        with pytest.raises(ServiceError) as err:
            await w.gen("s", ids, n=2)
        assert err.value.code == ErrorCode.STORE_UNAVAILABLE
        w.archive._down_until = 0.0  # the breaker's pause after a failure is over
        assert await w.archive.lookup("s") is None, "nothing committed"
        released = {id(b) for b in w.engine.released}
        assert w.engine.lent and all(id(r) in released for r in w.engine.lent), "a record was not handed back"

        monkeypatch.setattr(w.archive.store, "put_chunks", store_put)
        more = [*ids, *greedy(ids, 2), 5]
        await turn(w, "s", more)
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*more, *greedy(more, 2)]
    finally:
        await w.registry.shutdown()


async def test_a_turn_reads_its_new_chunks_while_the_store_is_asked(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strict turn after this node's last save reads the chunks that save did not name while the store says
    which chunks it has: the store's answer is held until the engine's read has started, which a commit that asks
    first and reads after never does (the test would time out)."""
    w = store.world()
    await w.registry.start()
    try:
        await turn(w, "s", SYSTEM)
        ids = [*SYSTEM, *greedy(SYSTEM, 2), 9, 10, 11]
        has_chunks, reading = w.archive.has_chunks, signal_reads(w, monkeypatch)
        overlapped: list[bool] = []

        async def asked(keys: list[str]) -> list[int]:
            sizes = await has_chunks(keys)
            overlapped.append(await asyncio.wait_for(reading.wait(), 5) is True)
            return sizes

        monkeypatch.setattr(w.archive, "has_chunks", asked)
        await w.gen("s", ids, n=2)
        assert overlapped == [True]
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*ids, *greedy(ids, 2)][:-1]
        assert set(await store.chunks()) >= {c.key for c in meta.chunks}
    finally:
        await w.registry.shutdown()


async def test_a_chunk_lost_between_turns_is_read_again(store: Store) -> None:
    """A chunk of this node's last save that the store lost since (evicted, removed by hand) is not named
    missing by the next turn's commit: the commit finds it absent, reads it from the engine again and stores it,
    so another node restores the whole state."""
    w = store.world()
    await w.registry.start()
    try:
        await turn(w, "s", SYSTEM)
        meta = await w.archive.lookup("s")
        assert meta is not None and len(meta.chunks) == 4
        victim = meta.chunks[1].key
        await store.overwrite(victim, None)
        ids = [*SYSTEM, *greedy(SYSTEM, 2), 9, 10, 11]
        await turn(w, "s", ids)
        meta = await w.archive.lookup("s")
        assert meta is not None and victim in {c.key for c in meta.chunks}
        assert victim in await store.chunks(), "the lost chunk was stored again"
    finally:
        await w.registry.shutdown()
    await restores_elsewhere(store, "s", list(meta.tokens))


async def test_a_store_failing_while_a_turn_reads_hands_every_record_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store failing to say which chunks it has while the turn's new chunks are read answers
    ``STORE_UNAVAILABLE``, commits nothing of the turn and hands back every record the read took."""
    w = store.world()
    await w.registry.start()
    try:
        await turn(w, "s", SYSTEM)
        before = await w.archive.lookup("s")
        reading = signal_reads(w, monkeypatch)

        async def failing(keys: list[str]) -> list[int]:
            await asyncio.wait_for(reading.wait(), 5)
            raise ServiceError(ErrorCode.STORE_UNAVAILABLE, "the test's store failed")

        monkeypatch.setattr(w.archive, "has_chunks", failing)
        ids = [*SYSTEM, *greedy(SYSTEM, 2), 9, 10, 11]
        with pytest.raises(ServiceError) as err:
            await w.gen("s", ids, n=2)
        assert err.value.code == ErrorCode.STORE_UNAVAILABLE
        for _ in range(100):  # the cancelled read hands its records back as it unwinds
            released = {id(b) for b in w.engine.released}
            if all(id(r) in released for r in w.engine.lent):
                break
            await asyncio.sleep(0.01)
        assert w.engine.lent and all(id(r) in released for r in w.engine.lent), "a record was not handed back"
        assert await w.archive.lookup("s") == before, "the turn committed nothing"
    finally:
        await w.registry.shutdown()


async def test_a_strict_commit_prepares_its_metadata_while_its_chunks_are_written(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strict commit hands the store its metadata while the turn's chunk writes are still in flight (the
    store prepares it meanwhile) and the store commits it once they are done: a chunk write held until the
    metadata's put has begun completes (a commit that waited for its chunk writes first would never begin it),
    and the stored state restores on another node."""
    w = store.world()
    await w.registry.start()
    try:
        await turn(w, "s", SYSTEM)
        inner = w.archive.store
        store_put_chunks, store_put = inner.put_chunks, inner.put  # type: ignore[attr-defined]
        begun = asyncio.Event()
        order: list[str] = []

        async def held_chunks(chunks: dict[str, bytes]) -> int:
            order.append("chunks")
            await asyncio.wait_for(begun.wait(), 5)
            await asyncio.sleep(0.05)  # a metadata put that did not wait for this write would commit first
            written = await store_put_chunks(chunks)
            order.append("chunks written")
            return written

        async def meta_put(
            meta: SlotMeta, blob: bytes, *, lease: str | None = None, ready: Awaitable[object] | None = None
        ) -> SlotMeta:
            order.append("metadata")
            begun.set()
            stored = await store_put(meta, blob, lease=lease, ready=ready)
            order.append("committed")
            return stored

        monkeypatch.setattr(inner, "put_chunks", held_chunks)
        monkeypatch.setattr(inner, "put", meta_put)
        ids = [*SYSTEM, *greedy(SYSTEM, 2), 9, 10, 11]
        await w.gen("s", ids, n=2)
        # the metadata's put begins while the chunk write is in flight and commits after it; whether the chunk
        # write's task or the metadata's put reaches the store first is the event loop's scheduling
        assert sorted(order) == sorted(["chunks", "metadata", "chunks written", "committed"]), order
        assert order.index("chunks") < order.index("chunks written") < order.index("committed"), order
        assert order.index("metadata") < order.index("chunks written"), order
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*ids, *greedy(ids, 2)][:-1]
        assert set(await store.chunks()) >= {c.key for c in meta.chunks}
    finally:
        await w.registry.shutdown()
    await restores_elsewhere(store, "s", list(meta.tokens))
