"""Fixtures for the storage tests.

Assumed pytest settings: none are required. Async tests carry ``pytest.mark.asyncio`` and async
fixtures use ``pytest_asyncio.fixture``, so both asyncio_mode "strict" and "auto" work. The repo root
must be importable (``storage``, ``tests.redis_server``): ``python -m pytest`` from the root does that;
plain ``pytest`` needs ``pythonpath = ["."]`` in the pytest config. ``tests/storage`` has no
``__init__.py`` on purpose (it would be imported as a package named ``storage``).

Fixtures:
    redis_server (session): a real redis-server on a free port (also a unix socket), own temp dir.
    redis_cluster (session): a Redis Cluster of three masters (hash slots split between them).
    redis_sentinel (session): a master, its replica and a sentinel; stores reach the master through
        the sentinel (``redis+sentinel://``).
    harness: parametrized over "directory", "redis", "redis-cluster" and "redis-sentinel"; builds
        stores (each with a unique prefix, so no FLUSH is ever needed) and can damage what they stored.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import pytest_asyncio
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from storage.base import DEFAULT_CHUNK_SIZE, SlotStore
from storage.directory import DirectoryStore
from storage.redis_store import RedisStore
from tests.redis_server import RedisCluster3, SentinelSetup

T = TypeVar("T", RedisCluster3, SentinelSetup)


def _running(servers: T) -> Iterator[T]:
    """Start ``servers`` (a :class:`RedisCluster3` or :class:`SentinelSetup`), yield them, stop them."""
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster3]:
    """A three-master Redis Cluster shared by the session."""
    yield from _running(RedisCluster3(tmp_path_factory.mktemp("redis-cluster")))


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSetup]:
    """A master, its replica and a sentinel, shared by the session."""
    yield from _running(SentinelSetup(tmp_path_factory.mktemp("redis-sentinel")))


class StoreHarness:
    """Builds stores of one kind and reaches behind them to inspect or damage stored data."""

    def __init__(self, kind: str, tmp_path: Path, url: str | None, raw_url: str | None = None) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.url = url
        self.raw_url = raw_url or url  # where a plain client reaches the data (a sentinel's master)
        self.prefix = f"t{uuid.uuid4().hex[:12]}:"
        self.stores: list[SlotStore] = []
        self._raw: Redis | RedisCluster | None = None

    @property
    def is_redis(self) -> bool:
        return self.kind.startswith("redis")

    @property
    def root(self) -> Path:
        return self.tmp_path / "store"

    def make(self, *, ttl_s: float | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE) -> SlotStore:
        """A new store instance over the same data (same directory or same Redis + prefix)."""
        store: SlotStore
        if self.is_redis:
            assert self.url is not None
            store = RedisStore.from_url(
                self.url, prefix=self.prefix, ttl_s=ttl_s, chunk_size=chunk_size, socket_timeout=5.0
            )
        else:
            store = DirectoryStore(self.root, prefix=self.prefix, ttl_s=ttl_s, chunk_size=chunk_size)
        self.stores.append(store)
        return store

    def raw(self) -> Redis | RedisCluster:
        """A plain redis client on the same server (binary values)."""
        if self._raw is None:
            assert self.raw_url is not None
            if self.kind == "redis-cluster":
                self._raw = RedisCluster.from_url(self.raw_url)
            else:
                self._raw = Redis.from_url(self.raw_url)
        return self._raw

    async def artifacts(self, store: SlotStore, slot_id: str) -> set[str]:
        """What physically exists for a slot: Redis key suffixes ("meta", "blob:2:0", ...) or file names."""
        if self.is_redis:
            assert isinstance(store, RedisStore)
            base = store.meta_key(slot_id)[: -len(b"meta")]
            pattern = base.replace(b"[", b"\\[").replace(b"*", b"\\*").replace(b"?", b"\\?") + b"*"
            keys = [k async for k in self.raw().scan_iter(match=pattern)]
            return {k[len(base) :].decode() for k in keys} - {"lease"}
        assert isinstance(store, DirectoryStore)
        sdir = store.slot_dir(slot_id)
        return set(os.listdir(sdir)) if sdir.exists() else set()

    async def mutate_blob(self, store: SlotStore, slot_id: str, fn: Callable[[bytes], bytes]) -> None:
        """Replace the stored (encoded) blob by ``fn(blob)`` behind the store's back, keeping the meta.

        Redis: the result is cut at the original chunk boundaries (a shorter result shortens the last
        chunks). Directory: the file's blob region is rewritten (the header is kept, so a length change
        reads as truncation).
        """
        if self.is_redis:
            assert isinstance(store, RedisStore)
            meta = await store.get_meta(slot_id)
            assert meta is not None
            keys = [store.chunk_key(slot_id, meta.generation, i) for i in range(meta.n_chunks)]
            old = b"".join([await self.raw().get(k) for k in keys])
            new = fn(old)
            size = store.chunk_size
            for i, key in enumerate(keys):
                await self.raw().set(key, new[i * size : (i + 1) * size], keepttl=True)
            return
        assert isinstance(store, DirectoryStore)
        path = store.slot_dir(slot_id) / "slot.bin"
        data = path.read_bytes()
        meta = await store.get_meta(slot_id)
        assert meta is not None
        head, blob = data[: len(data) - meta.stored_size], data[len(data) - meta.stored_size :]
        path.write_bytes(head + fn(blob))

    async def aclose(self) -> None:
        """Close the stores; delete this harness's Redis keys (by prefix only, never FLUSH)."""
        if self.is_redis:
            raw = self.raw()
            keys = [k async for k in raw.scan_iter(match=self.prefix.encode() + b"*")]
            for key in keys:
                await raw.delete(key)
            await raw.aclose()
        for store in self.stores:
            await store.close()


@pytest.fixture(params=["directory", "redis", "redis-cluster", "redis-sentinel"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Which store implementation a contract test runs against."""
    return request.param


@pytest_asyncio.fixture
async def harness(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[StoreHarness]:
    """A :class:`StoreHarness` for ``store_kind`` (starts the needed redis-server lazily)."""
    url = raw_url = None
    if store_kind == "redis":
        url = request.getfixturevalue("redis_server").url
    elif store_kind == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        url, raw_url = cluster.url, cluster.nodes[0].url
    elif store_kind == "redis-sentinel":
        setup = request.getfixturevalue("redis_sentinel")
        url, raw_url = setup.url, setup.master.url
    h = StoreHarness(store_kind, tmp_path, url, raw_url)
    yield h
    await h.aclose()
