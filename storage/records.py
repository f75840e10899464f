"""Small named records beside the slots in either store: what a slot's conversation needs besides
its KV state (the Responses API's stored conversations, docs/api.md, "POST /v1/responses").

A record is an opaque byte string (a few KB: messages, not KV) under a name chosen by the caller
(the orchestrator puts the tenant in it), with the store's time to live.  Where it lives:

* :class:`storage.redis_store.RedisStore`: the string key ``<prefix>rec:{<name>}``, written with
  ``SET ... PX <ttl>`` (one command: atomic), read with ``GET``;
* :class:`storage.directory.DirectoryStore`: ``root/<namespace>/records/<safe_name(name)>``, written
  to a temporary file and renamed over it (atomic); an entry older than the TTL reads as absent.

Failures raise :class:`storage.errors.StoreUnavailableError`, as the stores' own calls do.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import cast

from storage.base import SlotStore, validate_slot_id
from storage.directory import DirectoryStore, safe_name
from storage.errors import StoreUnavailableError
from storage.redis_store import RedisStore, escape_tag
from storage.redis_url import unavailable

__all__ = ["get_record", "put_record"]

MAX_RECORD_BYTES = 16 << 20


def _inner(store: SlotStore) -> SlotStore:
    """The store behind a wrapper (:class:`storage.timeouts.TimeoutStore` keeps it as ``inner``)."""
    return cast(SlotStore, getattr(store, "inner", store))


def _redis_key(store: RedisStore, name: str) -> bytes:
    return store.prefix.encode("utf-8") + b"rec:{" + escape_tag(validate_slot_id(name)) + b"}"


def _record_path(store: DirectoryStore, name: str) -> Path:
    return store.dir / "records" / safe_name(validate_slot_id(name))


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{secrets.token_hex(6)}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_file(path: Path, ttl_s: float | None) -> bytes | None:
    try:
        if ttl_s is not None and time.time() - path.stat().st_mtime > ttl_s:
            return None
        return path.read_bytes()
    except FileNotFoundError:
        return None


async def put_record(store: SlotStore, name: str, data: bytes) -> None:
    """Store ``data`` (at most 16 MiB) under ``name`` (1..1024 bytes of UTF-8), replacing any record
    of that name, with the store's time to live.  ``ValueError`` for a bad name or size;
    ``StoreUnavailableError``; ``TypeError`` for a store kind that keeps no records."""
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"a record holds at most {MAX_RECORD_BYTES} bytes, not {len(data)}")
    inner = _inner(store)
    if isinstance(inner, RedisStore):
        ttl_ms = max(1, round(inner.ttl_s * 1000)) if inner.ttl_s else None
        async with unavailable("put_record"):
            await inner.redis.set(_redis_key(inner, name), data, px=ttl_ms)
        return
    if isinstance(inner, DirectoryStore):
        try:
            await asyncio.to_thread(_write_file, _record_path(inner, name), data)
        except OSError as exc:
            raise StoreUnavailableError(f"record directory {inner.dir}: {exc}") from exc
        return
    raise TypeError(f"{type(inner).__name__} keeps no records")


async def get_record(store: SlotStore, name: str) -> bytes | None:
    """The record ``name`` (None: never stored, or expired).  Errors as :func:`put_record`'s."""
    inner = _inner(store)
    if isinstance(inner, RedisStore):
        async with unavailable("get_record"):
            return cast("bytes | None", await inner.redis.get(_redis_key(inner, name)))
    if isinstance(inner, DirectoryStore):
        try:
            return await asyncio.to_thread(_read_file, _record_path(inner, name), inner.ttl_s)
        except OSError as exc:
            raise StoreUnavailableError(f"record directory {inner.dir}: {exc}") from exc
    raise TypeError(f"{type(inner).__name__} keeps no records")
