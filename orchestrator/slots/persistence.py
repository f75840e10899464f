"""The slot archive: SES1 states, compressed, in the state store.  It knows no registry.

:class:`SlotArchive` is the orchestrator's one road to a :class:`storage.base.SlotStore`:

* :meth:`SlotArchive.write` compresses a SES1 blob (:mod:`slotstate.ses1`, in a thread) and
  stores it with its metadata and the model fingerprint (:func:`storage.slot_codec.save_slot`);
  writes of one slot run one at a time, and a write older than the stored one is skipped
  (:meth:`next_version` orders them).
* :meth:`SlotArchive.load` fetches, refuses another model's state (``BAD_STATE``, before
  llama.cpp sees it), decompresses and checks it (:func:`storage.slot_codec.load_slot`).
* Leases (``SET NX PX`` and token-checked renew/release, :mod:`storage.leases`) pass through
  for :class:`orchestrator.slots.leases.LeaseKeeper`.  Writes and deletes carry the writer's
  lease token: the store commits them only while that token holds the slot's lease, checked in
  the same atomic step (:meth:`storage.base.SlotStore.put`).  A refused write is logged, counted
  (``slotserve_stale_writes_refused_total``) and raised as :class:`OwnershipLost`.

Storage errors become API errors here, once: ``STORE_UNAVAILABLE`` (HTTP 503) when the store
fails or misses its deadline (``--store-timeout``, :class:`storage.timeouts.TimeoutStore`),
``BAD_STATE`` for a foreign or damaged state.  After a failure, calls that need the store
get ``STORE_UNAVAILABLE`` at once for ``breaker_s`` seconds (a circuit breaker; ``/health``
pings and the write-behind's retries probe the store meanwhile), and :attr:`healthy` is
False until a call succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import structlog

from contract.errors import ErrorCode
from orchestrator import metrics
from orchestrator.service_error import ServiceError
from orchestrator.tenants.principal import DEFAULT_TENANT
from storage.base import ChunkRef, ChunkStore, SlotMeta, SlotStore
from storage.errors import BadStateError, FingerprintMismatchError, LeaseLostError, StoreUnavailableError
from storage.factory import open_store
from storage.records import get_record, put_record
from storage.slot_codec import load_slot, save_chunks, save_slot
from storage.timeouts import TimeoutStore

if TYPE_CHECKING:
    from orchestrator.config import Settings

T = TypeVar("T")

log = structlog.get_logger("slotserve.archive")


class OwnershipLost(ServiceError):
    """This node wrote (or was about to write) a slot whose lease it does not hold: the write was
    refused and the node must drop its copy (``SLOT_BUSY``, HTTP 409: another node owns it)."""

    def __init__(self, slot_id: str, why: str) -> None:
        super().__init__(ErrorCode.SLOT_BUSY, f"slot {slot_id!r}: {why}; this node dropped its copy", slot_id=slot_id)


def refused_write(slot_id: str, why: str) -> OwnershipLost:
    """Log and count a refused stale write of ``slot_id``; the error to raise."""
    log.warning("stale write refused", slot_id=slot_id, reason=why)
    metrics.STALE_WRITES_REFUSED.inc()
    return OwnershipLost(slot_id, why)


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/slotserve`` (``~/.local/state/slotserve``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "slotserve"


class SlotArchive:
    """SES1 states of slots in one store (see module docstring).

    ``fingerprint()`` returns the loaded model's fingerprint (raising ``NO_MODEL`` while
    none is loaded); ``codec``/``level``: :func:`storage.slot_codec.save_slot`'s.
    """

    def __init__(
        self,
        store: SlotStore,
        fingerprint: Callable[[], str],
        *,
        codec: str,
        level: int,
        store_timeout_s: float,
        breaker_s: float = 2.0,
    ) -> None:
        self.store: SlotStore = TimeoutStore(store, store_timeout_s)  # type: ignore[assignment]
        self.timeout_s = store_timeout_s
        self.fingerprint = fingerprint
        self.codec = codec
        self.level = level
        self.breaker_s = breaker_s
        self.healthy = True
        self._down_until = 0.0
        self._version = 0
        self._written: dict[str, int] = {}
        self._write_locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def from_settings(cls, settings: Settings, fingerprint: Callable[[], str]) -> SlotArchive:
        """Build from ``--redis-url`` / ``--state-dir`` and the codec options (nothing contacted yet)."""
        store = open_store(
            settings.redis_url,
            settings.state_dir or default_state_dir(),
            prefix=settings.key_prefix,
            ttl_s=settings.state_ttl_s,
            chunk_size=settings.chunk_bytes,
        )
        return cls(
            store,
            fingerprint,
            codec=settings.codec,
            level=settings.codec_level,
            store_timeout_s=settings.store_timeout_s,
        )

    # ------------------------------------------------------------------ the edge

    async def _call(self, call: Awaitable[T], slot_id: str = "") -> T:
        """Await a store call, mapping storage errors to :class:`ServiceError` (the one place that does)."""
        try:
            result = await call
        except StoreUnavailableError as exc:
            self.healthy = False
            self._down_until = time.monotonic() + self.breaker_s
            raise ServiceError(ErrorCode.STORE_UNAVAILABLE, f"state store unavailable: {exc}") from exc
        except FingerprintMismatchError as exc:
            raise ServiceError(ErrorCode.BAD_STATE, f"slot {slot_id!r} was saved by another model: {exc}") from exc
        except BadStateError as exc:
            raise ServiceError(ErrorCode.BAD_STATE, f"stored state of slot {slot_id!r} is damaged: {exc}") from exc
        except LeaseLostError as exc:
            self.healthy, self._down_until = True, 0.0
            raise refused_write(slot_id, "the store refused the write: another node holds its lease") from exc
        self.healthy = True
        self._down_until = 0.0
        return result

    def check_up(self) -> None:
        """``STORE_UNAVAILABLE`` at once while the breaker is open (a store call failed just now)."""
        if time.monotonic() < self._down_until:
            raise ServiceError(
                ErrorCode.STORE_UNAVAILABLE,
                "state store unavailable (it failed just now; retrying in the background)",
            )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Ping the store; a failure only marks it unhealthy (requests then get ``STORE_UNAVAILABLE``)."""
        with contextlib.suppress(ServiceError):
            await self._call(self.store.ping())

    async def check(self, timeout: float = 1.0) -> bool:
        """Ping the store now (for ``/health``); updates and returns :attr:`healthy`."""
        try:
            await self._call(asyncio.wait_for(self.store.ping(), timeout))
        except (ServiceError, TimeoutError, OSError):
            self.healthy = False
        return self.healthy

    async def close(self) -> None:
        """Close the store's connections (errors are ignored: the process is ending)."""
        with contextlib.suppress(Exception):
            await self.store.close()

    async def purge_expired(self) -> None:
        """Drop entries past their TTL where the store needs that done (the directory store)."""
        purge = getattr(self.store.inner, "purge_expired", None)  # type: ignore[attr-defined]
        if purge is not None:
            await self._call(self.store.purge_expired())  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ states

    async def lookup(self, slot_id: str) -> SlotMeta | None:
        """Stored metadata of ``slot_id`` (None if not stored); ``STORE_UNAVAILABLE`` if the store is down."""
        self.check_up()
        return await self._call(self.store.get_meta(slot_id), slot_id)

    async def list_stored(self) -> list[SlotMeta]:
        """Every stored slot's metadata (empty while the store is down)."""
        try:
            self.check_up()
            return await self._call(self.store.list_meta())
        except ServiceError:
            return []

    def next_version(self) -> int:
        """A number ordering snapshots: take it when the state is read from the engine."""
        self._version += 1
        return self._version

    def _write_lock(self, slot_id: str) -> asyncio.Lock:
        return self._write_locks.setdefault(slot_id, asyncio.Lock())

    async def write(
        self,
        slot_id: str,
        tokens: Sequence[int],
        ses1: bytes,
        version: int,
        lease: str | None = None,
        *,
        tenant: str = "",
        partition: str = "",
    ) -> SlotMeta | None:
        """Compress and store ``ses1`` (a SES1 blob of ``tokens``) as ``slot_id``'s state (the slot's
        key, ``tenant/id``), fenced by the lease token ``lease`` (None: unfenced); ``tenant`` and the
        cache ``partition`` are kept in the metadata.

        Returns the stored metadata, or None when a newer snapshot (higher ``version``) is
        already stored.  ``STORE_UNAVAILABLE`` when the store fails; :class:`OwnershipLost`
        when ``lease`` no longer holds the slot's lease (nothing stored).
        """
        save = save_slot(
            self.store, slot_id, self.fingerprint(), tokens, ses1,
            codec=self.codec, level=self.level, lease=lease, tenant=tenant, partition=partition,
        )  # fmt: skip
        return await self._ordered(slot_id, version, tenant, save)

    async def _ordered(
        self, slot_id: str, version: int, tenant: str, save: Coroutine[Any, Any, SlotMeta]
    ) -> SlotMeta | None:
        """Run ``save`` unless a newer snapshot than ``version`` is stored (then None, ``save`` closed)."""
        async with self._write_lock(slot_id):
            if version < self._written.get(slot_id, 0):
                save.close()  # never awaited
                return None
            meta = await self._call(save, slot_id)
            self._written[slot_id] = version
        metrics.SAVES.labels(tenant or DEFAULT_TENANT).inc()
        return meta

    @property
    def keeps_chunks(self) -> bool:
        """Whether the store keeps KV chunks (:class:`storage.base.ChunkStore`): incremental states."""
        return isinstance(self.store, ChunkStore)

    async def has_chunks(self, keys: list[str]) -> list[int]:
        """The stored size of each chunk of ``keys``, -1 where absent (touching them:
        :meth:`storage.base.ChunkStore.has_chunks`)."""
        self.check_up()
        return await self._call(self.store.has_chunks(keys))  # type: ignore[attr-defined]

    async def put_chunks(self, chunks: dict[str, bytes]) -> int:
        """Store the KV chunks ``chunks`` (key -> sealed record) ahead of the metadata that will name them
        (:meth:`storage.base.ChunkStore.put_chunks`; one present is only touched); returns the bytes written,
        counted in ``slotserve_state_bytes_written_total``.  ``STORE_UNAVAILABLE``."""
        self.check_up()
        written = await self._call(self.store.put_chunks(chunks))  # type: ignore[attr-defined]
        metrics.STATE_BYTES_WRITTEN.inc(written)
        return cast(int, written)

    async def write_chunks(
        self,
        slot_id: str,
        tokens: Sequence[int],
        chunks: Sequence[ChunkRef],
        new: dict[str, bytes],
        rest: bytes,
        version: int,
        lease: str | None = None,
        *,
        tenant: str = "",
        partition: str = "",
        ready: Awaitable[object] | None = None,
    ) -> SlotMeta | None:
        """:meth:`write` of an incremental state (:func:`storage.slot_codec.save_chunks`): the chunks ``new``
        (key -> sealed record) first, then the metadata naming ``chunks`` with ``rest``, committed once ``ready``
        (chunk writes in flight: :meth:`put_chunks`, which counts their bytes) is done.  Counts the bytes
        written (``slotserve_state_bytes_written_total``)."""
        save = save_chunks(
            self.store, slot_id, self.fingerprint(), tokens, chunks, new, rest,
            codec=self.codec, level=self.level, lease=lease, tenant=tenant, partition=partition, ready=ready,
        )  # fmt: skip

        async def counted() -> SlotMeta:
            meta, written = await save
            metrics.STATE_BYTES_WRITTEN.inc(written + meta.stored_size)  # the chunks written and the blob
            return meta

        return await self._ordered(slot_id, version, tenant, counted())

    async def sweep_chunks(self, grace_s: float) -> int:
        """Remove the KV chunks no stored slot names, untouched for ``grace_s`` s (0 without chunks)."""
        if not self.keeps_chunks:
            return 0
        self.check_up()
        return await self._call(self.store.sweep_chunks(grace_s))  # type: ignore[attr-defined]

    async def settled(self, slot_id: str) -> None:
        """Wait for a write of ``slot_id`` in flight to end."""
        async with self._write_lock(slot_id):
            pass

    async def load(self, slot_id: str) -> tuple[SlotMeta, bytes | bytearray] | None:
        """``(meta, ses1_blob)`` of a stored slot, checked (None if not stored or expired).

        ``BAD_STATE`` for another model's or a damaged state, ``STORE_UNAVAILABLE``.
        """
        self.check_up()
        return await self._call(load_slot(self.store, slot_id, self.fingerprint()), slot_id)

    async def delete(self, slot_id: str, lease: str | None = None) -> bool:
        """Remove a slot's stored state (a write of an older snapshot still in flight is dropped),
        fenced by ``lease`` as :meth:`write` is (:class:`OwnershipLost`)."""
        self.check_up()
        version = self.next_version()
        async with self._write_lock(slot_id):
            self._written[slot_id] = version
            return await self._call(self.store.delete(slot_id, lease=lease), slot_id)

    # ------------------------------------------------------------------ records

    async def put_record(self, name: str, data: bytes) -> None:
        """Store the small record ``data`` under ``name`` (:func:`storage.records.put_record`);
        ``STORE_UNAVAILABLE``."""
        self.check_up()
        await self._call(asyncio.wait_for(put_record(self.store, name, data), self.timeout_s), name)

    async def get_record(self, name: str) -> bytes | None:
        """The record ``name`` or None (:func:`storage.records.get_record`); ``STORE_UNAVAILABLE``."""
        self.check_up()
        return await self._call(asyncio.wait_for(get_record(self.store, name), self.timeout_s), name)

    # ------------------------------------------------------------------ leases

    async def acquire_lease(self, slot_id: str, owner: str, ttl_ms: int) -> str | None:
        """:meth:`storage.base.SlotStore.acquire_lease` (a token, or None while another owner holds it)."""
        self.check_up()
        return await self._call(self.store.acquire_lease(slot_id, owner, ttl_ms), slot_id)

    async def renew_lease(self, slot_id: str, token: str, ttl_ms: int) -> bool:
        """:meth:`storage.base.SlotStore.renew_lease` (False: the lease was lost)."""
        return await self._call(self.store.renew_lease(slot_id, token, ttl_ms), slot_id)

    async def release_lease(self, slot_id: str, token: str) -> bool:
        """:meth:`storage.base.SlotStore.release_lease`."""
        return await self._call(self.store.release_lease(slot_id, token), slot_id)

    async def lease_owner(self, slot_id: str) -> str | None:
        """Who holds ``slot_id``'s lease (a node id), or None."""
        return await self._call(self.store.lease_owner(slot_id), slot_id)
