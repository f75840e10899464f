"""The harness of the incremental-state tests (fake engine; the directory store or a real redis-server the test
run starts): :class:`Store`, which builds nodes on one store and reads or damages its chunks behind its back, and
the steps those tests share.  The ``store`` fixture (both stores) is in ``tests/orchestrator/conftest.py``."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

from contract.protocol import KVRange
from storage.base import SlotMeta
from storage.redis_store import RedisStore
from tests.orchestrator.fake_world import CountingStore, World, greedy

CHUNK = 8  # positions per chunk in these tests (the default, 256, would make every test one chunk)
SYSTEM = [(7 * i) % 500 + 1 for i in range(30)]  # a "system prompt" of 30 tokens


class Store:
    """One store of the test (a directory, or a prefix in the session's redis-server): builds nodes on it and
    reads or damages its chunks behind its back."""

    def __init__(self, root: Path, redis_url: str | None) -> None:
        self.root = root
        self.redis_url = redis_url
        self.prefix = f"inc{uuid.uuid4().hex[:8]}:"
        self.raw = Redis.from_url(redis_url) if redis_url else None

    def world(self, **kw: object) -> World:
        url = self.redis_url
        store = RedisStore.from_url(url, prefix=self.prefix) if url else CountingStore(self.root)
        kw.setdefault("strict", True)
        w = World(self.root, store=store, **kw)  # type: ignore[arg-type]
        assert w.registry.durability is not None
        w.registry.durability.increments.chunk_tokens = CHUNK
        return w

    def _key(self, key: str) -> bytes:
        return self.prefix.encode() + b"chunk:" + key.encode()

    async def chunks(self) -> dict[str, bytes]:
        """Every stored chunk: key -> stored value."""
        if self.raw is None:
            return {p.name: p.read_bytes() for p in self.root.rglob("chunks/*/*") if not p.name.startswith(".tmp-")}
        base = self._key("")
        return {k[len(base) :].decode(): await self.raw.hget(k, "v") async for k in self.raw.scan_iter(base + b"*")}  # type: ignore[misc]

    async def overwrite(self, key: str, value: bytes | None) -> None:
        """Replace chunk ``key``'s value (None: remove the chunk)."""
        if self.raw is not None:
            await (self.raw.delete(self._key(key)) if value is None else self.raw.hset(self._key(key), "v", value))
            return
        path = next(self.root.rglob(f"chunks/*/{key}"))
        if value is None:
            path.unlink()
        else:
            path.write_bytes(value)


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


async def restores_elsewhere(store: Store, slot: str, tokens: list[int]) -> None:
    """Another node on the same store restores ``slot`` (stored with ``tokens``) whole from its chunks and goes on
    from it."""
    w2 = store.world(node="node-b")
    await w2.registry.start()
    try:
        more = [*tokens, 4]
        assert (await w2.gen(slot, more, n=2)).n_cached == len(tokens), "the restored state held every token"
        assert w2.seq_tokens(slot) == [*more, *greedy(more, 2)]
    finally:
        await w2.registry.shutdown()


def signal_reads(w: World, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """An event set when the engine is first asked for KV ranges (``read_kv`` with ranges)."""
    read_kv, reading = w.engine.read_kv, asyncio.Event()

    async def read(seq: int, ranges: list[KVRange]) -> object:
        if ranges:
            reading.set()
        return await read_kv(seq, ranges)

    monkeypatch.setattr(w.engine, "read_kv", read)
    return reading
