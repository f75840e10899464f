"""Redis-specific behaviour: outages and hangs, AOF durability, URL forms, the atomic-read fallback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from storage import redis_store
from storage.base import SlotMeta
from storage.directory import DirectoryStore
from storage.errors import BadStateError, StoreUnavailableError
from storage.factory import open_store
from storage.redis_store import RedisStore
from storage.redis_url import parse_hosts
from tests.redis_server import RedisSentinel, RedisServer, free_port


def meta_for(slot_id: str, blob: bytes, k: int = 0) -> SlotMeta:
    return SlotMeta(slot_id, "fp", 1, [k], "none", 0, len(blob), len(blob), 0.0, 0.0)


def all_ops(store: RedisStore) -> dict[str, Callable[[], Awaitable[object]]]:
    return {
        "ping": store.ping,
        "get": lambda: store.get("s"),
        "get_meta": lambda: store.get_meta("s"),
        "put": lambda: store.put(meta_for("s", b"new"), b"new"),
        "delete": lambda: store.delete("s"),
        "list_meta": store.list_meta,
        "acquire_lease": lambda: store.acquire_lease("s", "n1", 1000),
        "lease_owner": lambda: store.lease_owner("s"),
    }


async def assert_all_unavailable(store: RedisStore, limit_s: float) -> None:
    for name, op in all_ops(store).items():
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await asyncio.wait_for(op(), timeout=limit_s + 5)
        elapsed = time.monotonic() - start
        assert elapsed < limit_s, f"{name} took {elapsed:.2f}s to fail"


@pytest.mark.asyncio
async def test_outage_then_recovery_keeps_aof_data(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    store = RedisStore.from_url(server.url, socket_timeout=1.0, connect_timeout=1.0, chunk_size=1000)
    try:
        written = await store.put(meta_for("s", b"d" * 4200, 7), b"d" * 4200)
        token = await store.acquire_lease("s", "n1", 60_000)
        server.stop()
        await assert_all_unavailable(store, limit_s=2.0)
        server.start()  # same port and dir: the AOF is replayed
        await store.ping()
        assert await store.get("s") == (written, b"d" * 4200)
        assert await store.lease_owner("s") == "n1"
        assert await store.release_lease("s", token) is True  # type: ignore[arg-type]
        again = await store.put(meta_for("s", b"e"), b"e")
        assert again.generation == 2
    finally:
        await store.close()
        server.stop()


@pytest.mark.asyncio
async def test_hung_server_times_out(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    store = RedisStore.from_url(server.url, socket_timeout=0.3, connect_timeout=0.3, retries=1)
    try:
        await store.put(meta_for("s", b"x"), b"x")
        server.pause()
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await asyncio.wait_for(store.get("s"), timeout=10)
        assert time.monotonic() - start < 3.0
        server.resume()
        await store.ping()
        got = await store.get("s")
        assert got is not None and got[1] == b"x"
    finally:
        await store.close()
        server.stop()


@pytest.mark.asyncio
async def test_unreachable_url_is_unavailable() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5, retries=0)
    try:
        with pytest.raises(StoreUnavailableError):
            await store.ping()
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_unix_socket_url(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.unix_url, prefix="t-unix:")
    try:
        stored = await store.put(meta_for("u", b"via unix"), b"via unix")
        assert await store.get("u") == (stored, b"via unix")
        assert await store.delete("u") is True
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_sentinel_url(redis_server: RedisServer, tmp_path: Path) -> None:
    sentinel = RedisSentinel(tmp_path / "sentinel", redis_server.port)
    sentinel.start()
    store = RedisStore.from_url(sentinel.url, prefix="t-sentinel:", chunk_size=100)
    try:
        await store.ping()
        stored = await store.put(meta_for("s", b"y" * 250), b"y" * 250)
        assert stored.n_chunks == 3
        assert await store.get("s") == (stored, b"y" * 250)
        direct = RedisStore.from_url(redis_server.url, prefix="t-sentinel:")
        assert await direct.get_meta("s") == stored  # it really went to the monitored master
        await direct.close()
        assert await store.delete("s") is True
    finally:
        await store.close()
        sentinel.stop()


@pytest.mark.asyncio
async def test_atomic_read_fallback(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_store, "_OPTIMISTIC_READS", 0)  # always use the Lua read
    store = RedisStore.from_url(redis_server.url, prefix="t-atomic:", chunk_size=1000)
    try:
        assert await store.get("s") is None
        stored = await store.put(meta_for("s", b"z" * 3500), b"z" * 3500)
        assert await store.get("s") == (stored, b"z" * 3500)
        await store.redis.delete(store.chunk_key("s", 1, 1))
        with pytest.raises(BadStateError, match=r"chunks \[1\] missing"):
            await store.get("s")
        assert await store.delete("s") is True
    finally:
        await store.close()


def test_parse_hosts() -> None:
    assert parse_hosts("a:1,b,[::1]:7", 26379) == [("a", 1), ("b", 26379), ("::1", 7)]
    with pytest.raises(ValueError):
        parse_hosts("", 1)
    with pytest.raises(ValueError):
        parse_hosts("a:notaport", 1)


def test_url_validation() -> None:
    with pytest.raises(ValueError, match="scheme"):
        RedisStore.from_url("memcached://x")
    with pytest.raises(ValueError, match="service_name"):
        RedisStore.from_url("redis+sentinel://h:1")
    with pytest.raises(ValueError, match="databases"):
        RedisStore.from_url("redis+cluster://h:1/3")
    with pytest.raises(ValueError, match="prefix"):
        RedisStore.from_url("redis://h:1", prefix="{x}:")


@pytest.mark.asyncio
async def test_open_store_factory(tmp_path: Path) -> None:
    assert isinstance(open_store(None, tmp_path), DirectoryStore)
    assert isinstance(open_store(f"file://{tmp_path}/x", tmp_path), DirectoryStore)
    for url in (
        "redis://h:1/0",
        "rediss://h:1",
        "unix:///tmp/r.sock",
        "redis+sentinel://h:1/m",
        "redis+cluster://h:1",
    ):
        store = open_store(url, tmp_path)
        assert isinstance(store, RedisStore)
        await store.close()
    with pytest.raises(ValueError):
        open_store("ftp://h", tmp_path)
