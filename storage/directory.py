"""DirectoryStore: the embedded slot store (a local directory; the single-machine default).

Layout::

    root/<namespace>/<slot-name>/slot.bin

``<namespace>`` and ``<slot-name>`` are :func:`safe_name` encodings of the key prefix and slot id:
``s_`` + the UTF-8 bytes with every byte outside ``[a-z0-9_-]`` written as ``%XX`` (so ``"../x"``
becomes ``s_%2E%2E%2Fx`` and cannot escape ``root``; upper case is escaped too, so names stay distinct
on case-insensitive file systems), or ``h_`` + sha256 hex when that would exceed 200 characters.

``slot.bin`` holds meta AND blob in one file, so one ``os.replace`` switches both atomically: a reader
(or a crash at any moment) sees the old file or the new one, never a mismatched pair. Format, all
integers little-endian::

    b"SSD1" | u32 meta_len | f64 expires_at (unix s, 0 = never) | u64 blob_len | meta (msgpack) | blob

A put writes ``.tmp-<random>`` in the slot directory, fsyncs it (unless ``fsync=False``), renames it
over ``slot.bin`` and fsyncs the directory; a put given ``ready`` (the KV chunks it names being written)
writes and fsyncs the temporary file meanwhile and renames it once ``ready`` is done. Blocking I/O runs
in ``asyncio.to_thread``.

KV chunks of incremental states live in ``root/<namespace>/chunks/`` (:mod:`storage.directory_chunks`).

Concurrency: writers of one slot are serialized inside a process (the generation counter is a
read-modify-write). Several processes may read one directory; concurrent writers of the same slot in
different processes still never produce a mismatched pair, but may reuse a generation number.
Leases are kept in this process's memory (shared by instances with the same root and prefix). A fenced
put or delete (``lease=token``) checks the lease and renames (or unlinks) under one lock that lease
acquisition takes too, so the check and the commit are one step: a lease cannot change hands between.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import msgspec

from storage.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PREFIX,
    SlotMeta,
    decode_meta,
    encode_meta,
    now,
    validate_slot_id,
)
from storage.directory_chunks import ChunkFiles, fsync_dir
from storage.errors import BadStateError, LeaseLostError, StoreUnavailableError
from storage.leases import LeaseTable

__all__ = ["DirectoryStore", "safe_name"]

log = logging.getLogger(__name__)

_MAGIC = b"SSD1"
_HEADER = struct.Struct("<4sIdQ")
_FILE = "slot.bin"
_TMP_PREFIX = ".tmp-"
_MAX_NAME = 200
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_-")
_STALE_TMP_S = 3600.0
_N_LOCKS = 64
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Staged:
    """A slot's next version written to ``tmp`` (:meth:`DirectoryStore._stage`) as ``meta``, not yet in place."""

    tmp: Path
    meta: SlotMeta


_lease_tables: dict[tuple[Path, str], tuple[LeaseTable, threading.Lock]] = {}


def safe_name(raw: bytes) -> str:
    """A file name for arbitrary bytes: injective, no path separators, no dots, never empty."""
    name = "s_" + "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(name) > _MAX_NAME:
        name = "h_" + hashlib.sha256(raw).hexdigest()
    return name


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise BadStateError(f"slot file truncated: {what} needs {n} bytes, got {len(data)}")
    return data


class DirectoryStore:
    """Slot store in a local directory. See the module docstring for layout and guarantees.

    Args:
        root: base directory (created, with parents, on the first put or ping).
        prefix: key prefix; selects a namespace subdirectory (default "slotserve:").
        ttl_s: optional time to live of slot data in seconds, set/refreshed by each put; expired slots
            read as absent and are removed by :meth:`purge_expired` (or by delete/overwrite).
        chunk_size: accepted for interface parity; files are not chunked (``n_chunks`` is always 1).
        fsync: fsync files and the directory on put (durable across power loss; default True).
    """

    def __init__(
        self,
        root: Path | str,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        fsync: bool = True,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be positive or None")
        self.root = Path(root)
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.chunk_size = chunk_size
        self.fsync = fsync
        self.dir = self.root / safe_name(prefix.encode("utf-8")) if prefix else self.root
        self._locks = [asyncio.Lock() for _ in range(_N_LOCKS)]
        key = (self.root.resolve(), prefix)
        self._leases, self._fence = _lease_tables.setdefault(key, (LeaseTable(), threading.Lock()))
        self.chunks = ChunkFiles(self.dir / "chunks", fsync)

    # -- paths and file format ------------------------------------------------------------------

    def slot_dir(self, slot_id: str) -> Path:
        """Directory holding one slot's file (validates the id)."""
        return self.dir / safe_name(validate_slot_id(slot_id))

    def _lock(self, slot_id: str) -> asyncio.Lock:
        return self._locks[zlib.crc32(slot_id.encode("utf-8")) % _N_LOCKS]

    @staticmethod
    def _read_head(f: BinaryIO, path: Path) -> tuple[SlotMeta, float, int]:
        magic, meta_len, expires_at, blob_len = _HEADER.unpack(_read_exact(f, _HEADER.size, "header"))
        if magic != _MAGIC:
            raise BadStateError(f"{path} is not a slot file (magic {magic!r})")
        size = os.fstat(f.fileno()).st_size
        if size != _HEADER.size + meta_len + blob_len:
            raise BadStateError(
                f"{path} is {size} bytes; header says {_HEADER.size + meta_len + blob_len} (truncated?)"
            )
        meta = decode_meta(_read_exact(f, meta_len, "metadata"))
        if meta.stored_size != blob_len:
            raise BadStateError(f"{path}: meta says {meta.stored_size} blob bytes, file has {blob_len}")
        return meta, expires_at, blob_len

    @staticmethod
    def _expired(expires_at: float) -> bool:
        return expires_at > 0 and expires_at <= now()

    def _read(self, slot_id: str, with_blob: bool) -> tuple[SlotMeta, bytes | None] | None:
        path = self.slot_dir(slot_id) / _FILE
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return None
        with f:
            meta, expires_at, blob_len = self._read_head(f, path)
            if self._expired(expires_at):
                return None
            if meta.slot_id != slot_id:
                raise BadStateError(f"{path} holds slot {meta.slot_id!r}, not {slot_id!r}")
            blob = _read_exact(f, blob_len, "blob") if with_blob else None
        return meta, blob

    def _commit(self, slot_id: str, lease: str | None, commit: Callable[[], _T]) -> _T:
        """Run ``commit()`` (a rename or unlink) if ``lease`` is None or holds the slot's lease, both
        under the fence lock; LeaseLostError otherwise."""
        with self._fence:
            if lease is not None and not self._leases.holds(slot_id, lease):
                raise LeaseLostError(slot_id)
            return commit()

    def _stage(self, meta: SlotMeta, blob: bytes | memoryview) -> _Staged:
        """Write ``meta`` and ``blob`` as the slot's next version to a temporary file in its directory, fsynced
        unless ``fsync=False`` (the metadata's generation and creation time from the version stored now)."""
        sdir = self.slot_dir(meta.slot_id)
        try:
            prev = self._read(meta.slot_id, with_blob=False)
        except BadStateError:
            prev = None  # an unreadable old version is simply replaced
        t = now()
        if prev is not None:
            created, generation = prev[0].created_at, prev[0].generation + 1
        else:
            created, generation = (meta.created_at if meta.created_at > 0 else t), 1
        stored = msgspec.structs.replace(
            meta,
            stored_size=len(blob),
            n_chunks=1,
            generation=generation,
            created_at=created,
            updated_at=t,
        )
        meta_bytes = encode_meta(stored)
        expires_at = t + self.ttl_s if self.ttl_s else 0.0
        header = _HEADER.pack(_MAGIC, len(meta_bytes), expires_at, len(blob))
        sdir.mkdir(parents=True, exist_ok=True)
        tmp = sdir / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
        try:
            with open(tmp, "xb") as f:
                f.write(header)
                f.write(meta_bytes)
                f.write(blob)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return _Staged(tmp, stored)

    def _place(self, staged: _Staged, lease: str | None) -> SlotMeta:
        """Rename a staged version over the slot's file, fenced by ``lease`` (LeaseLostError: the staged file
        is removed, nothing stored), and fsync the directory.  FileNotFoundError (staged file removed) when
        another process removed the slot's (empty) directory meanwhile."""
        tmp = staged.tmp
        try:
            self._commit(staged.meta.slot_id, lease, lambda: os.replace(tmp, tmp.parent / _FILE))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            fsync_dir(tmp.parent)
        return staged.meta

    def _write(
        self, meta: SlotMeta, blob: bytes | memoryview, lease: str | None = None, staged: _Staged | None = None
    ) -> SlotMeta:
        """Stage (unless ``staged`` already is) and place the slot's next version; staged again when another
        process removed the (empty) slot directory under us (at most twice)."""
        for _ in range(2):
            try:
                return self._place(staged or self._stage(meta, blob), lease)
            except FileNotFoundError:
                staged = None  # retry from a fresh stage
        return self._place(self._stage(meta, blob), lease)

    def _remove(self, slot_id: str, lease: str | None = None) -> bool:
        sdir = self.slot_dir(slot_id)
        try:
            existed = self._read(slot_id, with_blob=False) is not None
        except BadStateError:
            existed = True
        try:
            self._commit(slot_id, lease, (sdir / _FILE).unlink)
        except FileNotFoundError:
            return False
        self._cleanup_dir(sdir, stale_only=False)
        return existed

    @staticmethod
    def _cleanup_dir(sdir: Path, stale_only: bool) -> None:
        try:
            for entry in os.scandir(sdir):
                if entry.name.startswith(_TMP_PREFIX):
                    try:
                        if not stale_only or entry.stat().st_mtime < time.time() - _STALE_TMP_S:
                            os.unlink(entry.path)
                    except FileNotFoundError:
                        pass
            sdir.rmdir()
        except OSError:
            pass  # not empty (a writer is active) or already gone

    def _slot_dirs(self) -> list[Path]:
        try:
            return [Path(e.path) for e in os.scandir(self.dir) if e.is_dir() and e.name[:2] in ("s_", "h_")]
        except FileNotFoundError:
            return []

    def _list(self) -> list[SlotMeta]:
        out = []
        for sdir in self._slot_dirs():
            path = sdir / _FILE
            try:
                with open(path, "rb") as f:
                    meta, expires_at, _ = self._read_head(f, path)
            except FileNotFoundError:
                continue
            except BadStateError as exc:
                log.warning("skipping unreadable slot file: %s", exc)
                continue
            if not self._expired(expires_at):
                out.append(meta)
        return out

    def _purge(self) -> int:
        removed = 0
        for sdir in self._slot_dirs():
            path = sdir / _FILE
            try:
                with open(path, "rb") as f:
                    _, expires_at, _ = self._read_head(f, path)
                if self._expired(expires_at):
                    path.unlink()
                    removed += 1
            except (FileNotFoundError, BadStateError):
                pass
            self._cleanup_dir(sdir, stale_only=True)
        return removed

    # -- async API --------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        try:
            return await asyncio.to_thread(fn, *args)
        except (BadStateError, LeaseLostError, ValueError, TypeError):
            raise
        except OSError as exc:
            raise StoreUnavailableError(f"slot directory {self.dir}: {exc}") from exc

    async def put(
        self,
        meta: SlotMeta,
        blob: bytes | memoryview,
        *,
        lease: str | None = None,
        ready: Awaitable[object] | None = None,
    ) -> SlotMeta:
        """Store ``blob`` (already encoded) with ``meta`` in one atomic file replace, fenced by ``lease``
        if given (LeaseLostError: refused, nothing stored); see SlotStore.put.  With ``ready`` the new
        version's file is written and fsynced while ``ready`` runs, and renamed into place once it is done
        (its exception: the file is removed, nothing stored)."""
        validate_slot_id(meta.slot_id)
        async with self._lock(meta.slot_id):
            if ready is None:
                return await self._run(self._write, meta, blob, lease)
            staging = asyncio.ensure_future(self._run(self._stage, meta, blob))
            try:
                await ready
            except BaseException:
                staged = await asyncio.gather(staging, return_exceptions=True)
                if isinstance(staged[0], _Staged):
                    staged[0].tmp.unlink(missing_ok=True)
                raise
            return await self._run(self._write, meta, blob, lease, await staging)

    async def get(self, slot_id: str) -> tuple[SlotMeta, bytes] | None:
        """``(meta, encoded_blob)`` or None if absent/expired; BadStateError if the file is damaged."""
        res = await self._run(self._read, slot_id, True)
        if res is None:
            return None
        meta, blob = res
        assert blob is not None
        return meta, blob

    async def get_meta(self, slot_id: str) -> SlotMeta | None:
        """Metadata without reading the blob, or None if absent/expired."""
        res = await self._run(self._read, slot_id, False)
        return None if res is None else res[0]

    async def delete(self, slot_id: str, *, lease: str | None = None) -> bool:
        """Remove a slot, fenced by ``lease`` if given (LeaseLostError); True if it existed (and had not
        expired)."""
        validate_slot_id(slot_id)
        async with self._lock(slot_id):
            return await self._run(self._remove, slot_id, lease)

    async def list_meta(self) -> list[SlotMeta]:
        """Metadata of every unexpired slot (unreadable files are logged and skipped)."""
        return await self._run(self._list)

    async def purge_expired(self) -> int:
        """Delete expired slots and stale temp files (older than 1 h); returns the number of slots removed."""
        return await self._run(self._purge)

    async def put_chunks(self, chunks: dict[str, bytes]) -> int:
        """See :meth:`storage.base.ChunkStore.put_chunks` (files: :mod:`storage.directory_chunks`)."""
        return await self._run(self.chunks.put, chunks)

    async def has_chunks(self, keys: list[str]) -> list[int]:
        """See :meth:`storage.base.ChunkStore.has_chunks`."""
        return await self._run(self.chunks.has, keys)

    async def get_chunks(self, keys: list[str], nbytes: int = 0) -> list[bytes | None]:
        """See :meth:`storage.base.ChunkStore.get_chunks`."""
        return await self._run(self.chunks.get, keys)

    async def drop_chunks(self, keys: list[str]) -> int:
        """See :meth:`storage.base.ChunkStore.drop_chunks`."""
        return await self._run(self.chunks.drop, keys)

    async def sweep_chunks(self, grace_s: float) -> int:
        """See :meth:`storage.base.ChunkStore.sweep_chunks` (the names: every listed slot's chunks)."""

        def sweep() -> int:
            return self.chunks.sweep((c.key for meta in self._list() for c in meta.chunks), grace_s)

        return await self._run(sweep)

    async def ping(self) -> None:
        """Check that the directory exists (creating it) and is writable; StoreUnavailableError if not."""

        def check() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.dir, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.dir} is not writable")

        await self._run(check)

    async def close(self) -> None:
        """Nothing to release (files are closed after each operation)."""

    async def acquire_lease(self, slot_id: str, owner: str, ttl_ms: int) -> str | None:
        """In-process lease; see SlotStore.acquire_lease."""
        validate_slot_id(slot_id)
        with self._fence:  # never between a fenced write's check and its commit
            return self._leases.acquire(slot_id, owner, ttl_ms)

    async def renew_lease(self, slot_id: str, token: str, ttl_ms: int) -> bool:
        """See SlotStore.renew_lease."""
        return self._leases.renew(slot_id, token, ttl_ms)

    async def release_lease(self, slot_id: str, token: str) -> bool:
        """See SlotStore.release_lease."""
        return self._leases.release(slot_id, token)

    async def lease_owner(self, slot_id: str) -> str | None:
        """See SlotStore.lease_owner."""
        return self._leases.owner(slot_id)
