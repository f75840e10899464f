"""A deadline on every store call, so a stalled backend fails fast instead of holding callers.

A paused or partitioned Redis answers nothing: redis-py then waits ``socket_timeout`` per
attempt and retries, which took 15 s before an error surfaced.  :class:`TimeoutStore` wraps
any :class:`storage.base.SlotStore` and turns a call that outlives its deadline into
:class:`storage.errors.StoreUnavailableError` (the call is cancelled: redis-py drops that
connection, the directory store's thread finishes in the background).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

from storage.base import SlotMeta, SlotStore
from storage.errors import StoreUnavailableError

__all__ = ["TimeoutStore"]

T = TypeVar("T")


class TimeoutStore:
    """``store`` with a deadline of ``timeout_s`` seconds per call (see module docstring).

    ``put``, ``put_chunks`` and ``get_chunks`` get ``timeout_s`` plus one second per ``bytes_per_s`` bytes
    written or read, so large states are not cut off on a healthy link.  Other attributes
    (``purge_expired``...) pass through.
    """

    def __init__(self, store: SlotStore, timeout_s: float = 3.0, bytes_per_s: float = 50e6) -> None:
        self.inner = store
        self.timeout_s = timeout_s
        self.bytes_per_s = bytes_per_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._deadline(attr(*args, **kwargs), self.timeout_s, name)

        return call

    async def _deadline(self, call: Awaitable[T], timeout_s: float, what: str) -> T:
        try:
            return await asyncio.wait_for(call, timeout_s)
        except TimeoutError as exc:
            raise StoreUnavailableError(f"state store did not answer {what} within {timeout_s:g} s") from exc

    async def put(
        self,
        meta: SlotMeta,
        blob: bytes | memoryview,
        *,
        lease: str | None = None,
        ready: Awaitable[object] | None = None,
    ) -> SlotMeta:
        """:meth:`SlotStore.put` (fenced by ``lease`` if given, committed once ``ready`` is done) with the
        size-scaled deadline (``ready``'s own calls have theirs)."""
        timeout = self.timeout_s + memoryview(blob).nbytes / self.bytes_per_s
        return await self._deadline(self.inner.put(meta, blob, lease=lease, ready=ready), timeout, "put")

    async def put_chunks(self, chunks: dict[str, bytes]) -> int:
        """:meth:`storage.base.ChunkStore.put_chunks` with the size-scaled deadline (AttributeError for a
        store without chunks)."""
        put_chunks = self.inner.put_chunks  # type: ignore[attr-defined]
        timeout = self.timeout_s + sum(len(v) for v in chunks.values()) / self.bytes_per_s
        return cast(int, await self._deadline(put_chunks(chunks), timeout, "put_chunks"))

    async def get_chunks(self, keys: list[str], nbytes: int = 0) -> list[bytes | None]:
        """:meth:`storage.base.ChunkStore.get_chunks` with the deadline scaled by ``nbytes``, the chunks' stored
        size (AttributeError for a store without chunks)."""
        get_chunks = self.inner.get_chunks  # type: ignore[attr-defined]
        timeout = self.timeout_s + nbytes / self.bytes_per_s
        return cast("list[bytes | None]", await self._deadline(get_chunks(keys, nbytes), timeout, "get_chunks"))
