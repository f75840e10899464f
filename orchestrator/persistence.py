"""Slot persistence: SES1 blobs, zstd-compressed, in the state store.

* :meth:`Persistence.save` takes a resident slot's state from the worker
  (``llama_state_seq_get_data``), packs it as SES1 (:mod:`storage.ses1`) and stores it through
  :func:`storage.slot_codec.save_slot` (compression in a thread, metadata with the
  model fingerprint, atomic put).
* :meth:`Persistence.load_into` does the reverse into an engine sequence; a blob of
  another model is refused (``BAD_STATE``) and never reaches llama.cpp.
* Write-behind: every finished generation :meth:`schedule` s its slot; a background
  task saves dirty slots shortly after (coalesced: one save per burst), retrying
  with backoff while the store is down (``healthy`` is then False and ``/health``
  says ``degraded``).  :meth:`shutdown` flushes everything dirty.  A background save
  holds the slot's lock only while it takes the state from the worker; compressing
  and writing happen after, so a slow store never blocks the slot's next turn.  Writes
  of one slot are ordered (a per-slot write lock; an older state never overwrites a
  newer one), and :meth:`ensure_saved` waits for a write in flight before parking.
* A stalled store fails fast: every store call has a deadline (``--store-timeout``,
  :class:`storage.timeouts.TimeoutStore`), and after a failure requests that need the
  store get ``STORE_UNAVAILABLE`` at once for ``breaker_s`` seconds (a circuit breaker;
  the write-behind retries and ``/health`` pings probe the store meanwhile).  Resident
  slots keep generating.
* Leases: with several orchestrators on one Redis a slot is owned by one node at a
  time (``SET NX PX`` lease, renewed while resident, released when parked).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from orchestrator import metrics
from orchestrator.engine_api import EngineClient
from orchestrator.errors import ApiError
from storage.base import SlotMeta, SlotStore
from storage.errors import BadStateError, FingerprintMismatchError, StoreUnavailableError
from storage.factory import open_store
from storage.ses1 import pack_ses1, unpack_ses1
from storage.slot_codec import load_slot, save_slot
from storage.timeouts import TimeoutStore

if TYPE_CHECKING:
    from orchestrator.config import Settings
    from orchestrator.slots import Slot, SlotRegistry

log = structlog.get_logger("slotserve.persistence")


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/slotserve`` (``~/.local/state/slotserve``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "slotserve"


class Persistence:
    """Saves, loads and leases slots in one :class:`storage.base.SlotStore` (see module docstring)."""

    def __init__(
        self,
        store: SlotStore,
        engine: EngineClient,
        *,
        codec: str = "auto",
        level: int = 3,
        node_id: str = "",
        lease_ms: int = 6_000,
        write_delay_s: float = 0.2,
        park_idle_s: float | None = None,
        store_timeout_s: float = 3.0,
        breaker_s: float = 2.0,
    ) -> None:
        self.store: SlotStore = TimeoutStore(store, store_timeout_s)  # type: ignore[assignment]
        self.breaker_s = breaker_s
        self._down_until = 0.0
        self._version = 0
        self._written: dict[str, int] = {}
        self._write_locks: dict[str, asyncio.Lock] = {}
        self.engine = engine
        self.codec = codec
        self.level = level
        self.node_id = node_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_ms = lease_ms
        self.write_delay_s = write_delay_s
        self.park_idle_s = park_idle_s
        self.registry: SlotRegistry | None = None
        self.healthy = True
        self.leases: dict[str, str] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_settings(cls, settings: Settings, engine: EngineClient) -> Persistence:
        """Build from ``--redis-url`` / ``--state-dir`` and the codec options."""
        store = open_store(
            settings.redis_url,
            settings.state_dir or default_state_dir(),
            prefix=settings.key_prefix,
            ttl_s=settings.state_ttl_s,
            chunk_size=settings.chunk_bytes,
        )
        return cls(
            store,
            engine,
            codec=settings.codec,
            level=settings.codec_level,
            # Stable across restarts of the same node, so a restarted node takes its leases back.
            node_id=settings.node_id or f"{socket.gethostname()}:{settings.port}",
            lease_ms=settings.lease_ms,
            park_idle_s=settings.park_idle_s or None,
            store_timeout_s=settings.store_timeout_s,
        )

    @property
    def fingerprint(self) -> str:
        """The loaded model's fingerprint (states of other models are refused)."""
        if self.engine.info is None:
            raise ApiError("NO_MODEL", "No model loaded")
        return self.engine.info.fingerprint

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Check the store (a failure only marks it unhealthy) and start background tasks."""
        try:
            await self.store.ping()
        except StoreUnavailableError as exc:
            self.healthy = False
            log.warning("state store unavailable at start", error=str(exc))
        self._tasks = [
            asyncio.create_task(self._write_behind(), name="write-behind"),
            asyncio.create_task(self._renew_leases(), name="lease-renew"),
            asyncio.create_task(self._maintain(), name="store-maintenance"),
        ]

    async def shutdown(self) -> None:
        """Flush every dirty slot, release leases, close the store."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.flush(wait_for_locks=True)
        for slot_id, token in list(self.leases.items()):
            with contextlib.suppress(Exception):
                await self.store.release_lease(slot_id, token)
        self.leases.clear()
        with contextlib.suppress(Exception):
            await self.store.close()

    async def check(self, timeout: float = 1.0) -> bool:
        """Ping the store now (for ``/health``); updates and returns ``healthy``."""
        try:
            await asyncio.wait_for(self.store.ping(), timeout)
            self._up()
        except (TimeoutError, StoreUnavailableError, OSError):
            self.healthy = False
        return self.healthy

    # ------------------------------------------------------------------ store access

    def _unavailable(self, exc: Exception) -> ApiError:
        self.healthy = False
        self._down_until = time.monotonic() + self.breaker_s
        return ApiError("STORE_UNAVAILABLE", f"state store unavailable: {exc}")

    def _up(self) -> None:
        self.healthy = True
        self._down_until = 0.0

    def _check_up(self) -> None:
        """``STORE_UNAVAILABLE`` at once while the breaker is open (a store call failed just now)."""
        if time.monotonic() < self._down_until:
            raise ApiError(
                "STORE_UNAVAILABLE", "state store unavailable (it failed just now; retrying in the background)"
            )

    async def lookup(self, slot_id: str) -> SlotMeta | None:
        """Stored metadata of ``slot_id`` (None if not stored); 503 if the store is down."""
        self._check_up()
        try:
            meta = await self.store.get_meta(slot_id)
        except StoreUnavailableError as exc:
            raise self._unavailable(exc) from exc
        self._up()
        return meta

    async def list_stored(self) -> list[SlotMeta]:
        """All stored slots' metadata (empty when the store is down)."""
        if time.monotonic() < self._down_until:
            return []
        try:
            return await self.store.list_meta()
        except StoreUnavailableError:
            self.healthy = False
            return []

    async def claim(self, slot: Slot) -> None:
        """Hold ``slot``'s lease (acquired once, renewed in the background).

        Raises ``SLOT_BUSY`` (with ``owner`` and ``retry_after``: the lease TTL in seconds, after
        which a dead owner's lease has lapsed) when another node holds it, and
        ``STORE_UNAVAILABLE`` when it cannot be acquired because the store is down.
        """
        if slot.id in self.leases:
            return
        self._check_up()
        try:
            token = await self.store.acquire_lease(slot.id, self.node_id, self.lease_ms)
            owner = None if token else await self.store.lease_owner(slot.id)
        except StoreUnavailableError as exc:
            raise self._unavailable(exc) from exc
        if token is None:
            # A live owner renews its lease every third of its TTL; a dead one's lease lapses within
            # one TTL, so that is when asking again can succeed (at the latest).
            raise ApiError(
                "SLOT_BUSY",
                f"slot {slot.id!r} is owned by node {owner!r}",
                slot_id=slot.id,
                owner=owner,
                retry_after=max(1, -(-self.lease_ms // 1000)),
            )
        self.leases[slot.id] = token

    async def release(self, slot: Slot) -> None:
        """Give up ``slot``'s lease (after parking it)."""
        token = self.leases.pop(slot.id, None)
        if token is not None:
            with contextlib.suppress(StoreUnavailableError):
                await self.store.release_lease(slot.id, token)

    async def save(self, slot: Slot) -> SlotMeta | None:
        """Persist a resident slot (lock held by the caller) now."""
        tokens, ses1, version = await self._snapshot(slot)
        return await self._write(slot, tokens, ses1, version)

    async def ensure_saved(self, slot: Slot) -> None:
        """Before ``slot`` (lock held) leaves the engine: wait for a write in flight, then save
        it if the store does not hold its current state (``STORE_UNAVAILABLE`` if it cannot)."""
        async with self._write_lock(slot.id):
            pass  # a background write that fails marks the slot dirty again
        if slot.dirty or (slot.n_tokens and not slot.stored):
            await self.save(slot)

    async def store_blob(self, slot: Slot, tokens: list[int], ses1: bytes) -> SlotMeta | None:
        """Store ``ses1`` (a SES1 blob of ``tokens``) as ``slot``'s state; the slot is then clean."""
        self._check_up()
        self._version += 1
        slot.dirty = False
        return await self._write(slot, tokens, ses1, self._version)

    def _write_lock(self, slot_id: str) -> asyncio.Lock:
        return self._write_locks.setdefault(slot_id, asyncio.Lock())

    async def _snapshot(self, slot: Slot) -> tuple[list[int], bytes, int]:
        """The resident slot's state as SES1 (lock held by the caller; fast: no store I/O).

        The slot counts as clean from here; :meth:`_write` marks it dirty again if the
        write fails.  Returns ``(tokens, ses1, version)``.
        """
        assert slot.seq is not None
        saved = await self.engine.save_state(slot.seq)
        self._version += 1
        slot.dirty = False
        return saved.tokens, pack_ses1(saved.tokens, saved.state), self._version

    async def _write(self, slot: Slot, tokens: list[int], ses1: bytes, version: int) -> SlotMeta | None:
        """Compress and store a snapshot unless a newer one of the slot is already stored.

        Writes of one slot run one at a time, in order.  Returns the stored metadata (None
        when skipped as stale); ``STORE_UNAVAILABLE`` when the store fails (the slot is then
        dirty again and queued for the write-behind).
        """
        async with self._write_lock(slot.id):
            if version < self._written.get(slot.id, 0):
                return None
            try:
                meta = await save_slot(
                    self.store, slot.id, self.fingerprint, tokens, ses1, codec=self.codec, level=self.level
                )
            except BaseException as exc:  # not stored: the write-behind tries again
                slot.dirty = True
                self._dirty.add(slot.id)
                if isinstance(exc, StoreUnavailableError):
                    raise self._unavailable(exc) from exc
                raise
            self._written[slot.id] = version
        self._up()
        slot.stored = True
        slot.stored_bytes, slot.raw_bytes = meta.stored_size, meta.raw_size
        if not slot.dirty:
            slot.n_tokens = meta.n_tokens
        metrics.SAVES.inc()
        return meta

    async def load_into(self, slot: Slot, seq: int) -> None:
        """Restore a parked slot into engine sequence ``seq`` (lock held by the caller)."""
        self._check_up()
        try:
            got = await load_slot(self.store, slot.id, self.fingerprint)
        except FingerprintMismatchError as exc:
            raise ApiError("BAD_STATE", f"slot {slot.id!r} was saved by another model: {exc}") from exc
        except BadStateError as exc:
            raise ApiError("BAD_STATE", f"stored state of slot {slot.id!r} is damaged: {exc}") from exc
        except StoreUnavailableError as exc:
            raise self._unavailable(exc) from exc
        self._up()
        if got is None:  # expired or deleted meanwhile: an empty slot
            await self.engine.erase(seq)
            slot.stored, slot.n_tokens = False, 0
            return
        meta, raw = got
        ses1 = unpack_ses1(raw)
        await self.engine.restore_state(seq, ses1.tokens, ses1.state)
        slot.n_tokens, slot.dirty = meta.n_tokens, False
        slot.stored_bytes, slot.raw_bytes = meta.stored_size, meta.raw_size
        metrics.RESTORES.inc()

    async def delete(self, slot_id: str) -> bool:
        """Remove a slot's stored state (a write of an older state still in flight is dropped)."""
        self._dirty.discard(slot_id)
        self._check_up()
        self._version += 1
        async with self._write_lock(slot_id):
            self._written[slot_id] = self._version
            try:
                return await self.store.delete(slot_id)
            except StoreUnavailableError as exc:
                raise self._unavailable(exc) from exc

    # ------------------------------------------------------------------ write-behind

    def schedule(self, slot: Slot) -> None:
        """Queue a save of ``slot`` (coalesced with other requests for it)."""
        slot.dirty = True
        self._dirty.add(slot.id)
        self._wake.set()

    async def flush(self, wait_for_locks: bool = False) -> int:
        """Save every dirty resident slot now; returns how many were saved."""
        saved = 0
        reg = self.registry
        if reg is None:
            return 0
        for slot_id in list(self._dirty):
            slot = reg.find(slot_id)
            if slot is None or not slot.dirty or not reg.is_resident(slot):
                self._dirty.discard(slot_id)
                continue
            if (slot.lock.locked() or slot.busy) and not wait_for_locks:
                continue  # busy: its own end schedules it again
            async with slot.lock:  # held only to take the state: the write happens after
                if not (slot.dirty and reg.is_resident(slot)):
                    self._dirty.discard(slot_id)
                    continue
                tokens, ses1, version = await self._snapshot(slot)
                self._dirty.discard(slot_id)
            if await self._write(slot, tokens, ses1, version) is not None:
                saved += 1
        return saved

    async def _write_behind(self) -> None:
        backoff = 0.5
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.write_delay_s)
            try:
                await self.flush()
                backoff = 0.5
            except ApiError as exc:
                log.warning("write-behind failed; retrying", error=exc.message, retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
                self._wake.set()
            except Exception as exc:
                log.exception("write-behind error", error=str(exc))
                await asyncio.sleep(backoff)
                self._wake.set()
            if self._dirty:
                self._wake.set()

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            for slot_id, token in list(self.leases.items()):
                try:
                    if not await self.store.renew_lease(slot_id, token, self.lease_ms):
                        log.warning("lost lease", slot_id=slot_id)
                        self.leases.pop(slot_id, None)
                except StoreUnavailableError:
                    self.healthy = False
                    break

    async def _maintain(self, every_s: float = 5.0) -> None:
        """Park idle slots (``--park-idle``) and purge expired entries of the directory store."""
        last_purge = 0.0
        while True:
            await asyncio.sleep(every_s)
            try:
                if self.park_idle_s and self.registry is not None:
                    await self.registry.park_idle(self.park_idle_s)
                purge = getattr(self.store, "purge_expired", None)
                if purge is not None and time.monotonic() - last_purge > 60:
                    last_purge = time.monotonic()
                    await purge()
            except Exception as exc:
                log.warning("store maintenance failed", error=str(exc))
