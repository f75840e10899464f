"""KV chunks of the Redis store (:class:`storage.base.ChunkStore`): one hash per chunk.

Key (``P`` = the store's prefix, ``K`` = the chunk key, :func:`storage.base.validate_chunk_key`)::

    P chunk:K    hash: v (the sealed chunk, :func:`slotstate.kv_chunks.seal`), t (last touch, Redis
                 server time in unix ms)

A chunk key has no hash tag: chunks are shared by every slot whose manifest names them, so in a Redis
Cluster they spread over the shards by their own key.  Every command here names one key, so every
pipeline and script works on a Cluster as on one server.

* :meth:`RedisChunks.put_chunks`: per chunk ``HSETNX v`` (written once; one present is left as it is)
  and the touch script, one pipeline per batch of at most :data:`BATCH_BYTES`.
* :meth:`RedisChunks.has_chunks`: the touch script per key (``HSTRLEN v``, ``t`` set to the server's
  ``TIME``, the store's TTL applied), one pipeline.
* :meth:`RedisChunks.get_chunks`: ``HSTRLEN`` of every key (one pipeline), then ``HGET v`` pipelined in
  batches of at most :data:`BATCH_BYTES`: a long restore is a few round trips, never one reply per
  chunk nor one reply of the whole state.
* :meth:`RedisChunks.drop_chunks`: ``DEL`` of chunks a restore found damaged, one pipeline.
* :meth:`RedisChunks.sweep_chunks`: the names of every stored manifest (:meth:`list_meta`), then a
  ``SCAN`` of the chunk keys; each one no manifest names is removed by a script that deletes it only
  if its ``t`` is older than the grace by the server's clock, checked and deleted in one atomic step.

Why touch times and a scan of the manifests rather than reference counts kept by the fenced commit
script: a count would have to be changed by the slot's commit script, whose keys all share the slot's
hash tag, while chunks live on other Cluster shards (a script may not reach them there); a slot
expiring by its TTL, or a node killed between its chunks and its commit, would leave counts wrong
forever.  With touch times a commit never touches a shared key: it writes its new chunks, having
touched every chunk it names moments before (:meth:`has_chunks`), and a sweep on any node spares
every chunk touched within the grace, so a commit in flight on another node keeps its chunks as long
as it commits within the grace (10 min by default).  A chunk that lost its ``t`` (a node died between
``HSETNX`` and the touch) is given one by the sweep and goes a grace later.  With a store TTL, each
touch sets the chunk's TTL too: a chunk lives at least as long as every manifest that names it (each
save touches all its chunks), so chunks also go when every node is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from storage.base import SlotMeta, validate_chunk_key
from storage.redis_url import glob_escape, unavailable

__all__ = ["BATCH_BYTES", "RedisChunks"]

BATCH_BYTES = 32 << 20
"""Most bytes of chunk values in one pipeline (a put's or a get's batch); a larger chunk goes alone."""
_SCAN_BATCH = 256

_NOW_MS = "local c = redis.call('TIME')\nlocal ms = string.format('%d', c[1] * 1000 + math.floor(c[2] / 1000))\n"

# KEYS[1]=chunk; ARGV[1]=ttl_ms (0: none) -> HSTRLEN v, or -1 (absent)
_TOUCH = (
    _NOW_MS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HSET', KEYS[1], 't', ms)
if tonumber(ARGV[1]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return redis.call('HSTRLEN', KEYS[1], 'v')
"""
)

# KEYS[1]=chunk; ARGV[1]=grace_ms -> 1 removed, 0 kept (touched within the grace; a chunk without t gets one)
_DROP_OLD = (
    _NOW_MS
    + """
local t = redis.call('HGET', KEYS[1], 't')
if not t then
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 't', ms) end
  return 0
end
if tonumber(ms) - tonumber(t) < tonumber(ARGV[1]) then return 0 end
return redis.call('DEL', KEYS[1])
"""
)


def _batches(sizes: list[int], limit: int) -> list[range]:
    """Consecutive index ranges of ``sizes`` whose sizes add up to at most ``limit`` (at least one each)."""
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += max(0, size)
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


class RedisChunks:
    """The :class:`storage.base.ChunkStore` methods of :class:`storage.redis_store.RedisStore` (module
    docstring): a mixin that uses the store's client (``redis``), key prefix (``_prefix``, bytes), TTL
    (``_ttl_ms``, 0 for none) and :meth:`list_meta`.  Redis errors of an outage raise
    :class:`storage.errors.StoreUnavailableError`; a malformed chunk key raises ValueError."""

    redis: Any
    _prefix: bytes
    _ttl_ms: int

    if TYPE_CHECKING:

        async def list_meta(self) -> list[SlotMeta]: ...

    def kv_chunk_key(self, key: str) -> bytes:
        """The Redis key of KV chunk ``key`` (ValueError for a malformed key)."""
        return self._prefix + b"chunk:" + validate_chunk_key(key).encode("ascii")

    async def put_chunks(self, chunks: dict[str, bytes]) -> int:
        """:meth:`storage.base.ChunkStore.put_chunks`: write each chunk not stored yet (``HSETNX``), touch
        every one; returns the bytes written."""
        keys = [self.kv_chunk_key(k) for k in chunks]
        values = list(chunks.values())
        written = 0
        async with unavailable("put_chunks"):
            for batch in _batches([len(v) for v in values], BATCH_BYTES):
                pipe = self.redis.pipeline(transaction=False)
                for i in batch:
                    pipe.hsetnx(keys[i], "v", values[i])
                    pipe.eval(_TOUCH, 1, keys[i], self._ttl_ms)
                replies = await pipe.execute()
                written += sum(len(values[i]) for i, new in zip(batch, replies[::2], strict=True) if new)
        return written

    async def has_chunks(self, keys: list[str]) -> list[int]:
        """:meth:`storage.base.ChunkStore.has_chunks`: each chunk's stored size in bytes, -1 where absent;
        a stored one is touched (one pipeline)."""
        rkeys = [self.kv_chunk_key(k) for k in keys]
        async with unavailable("has_chunks"):
            pipe = self.redis.pipeline(transaction=False)
            for key in rkeys:
                pipe.eval(_TOUCH, 1, key, self._ttl_ms)
            return [int(n) for n in await pipe.execute()] if rkeys else []

    async def get_chunks(self, keys: list[str], nbytes: int = 0) -> list[bytes | None]:
        """:meth:`storage.base.ChunkStore.get_chunks`: each chunk's value, None where absent; read in
        pipelined batches of at most :data:`BATCH_BYTES` (their sizes asked first, in one pipeline)."""
        rkeys = [self.kv_chunk_key(k) for k in keys]
        if not rkeys:
            return []
        out: list[bytes | None] = []
        async with unavailable("get_chunks"):
            pipe = self.redis.pipeline(transaction=False)
            for key in rkeys:
                pipe.hstrlen(key, "v")
            sizes = [int(n) for n in await pipe.execute()]
            for batch in _batches(sizes, BATCH_BYTES):
                pipe = self.redis.pipeline(transaction=False)
                for i in batch:
                    pipe.hget(rkeys[i], "v")
                out += cast("list[bytes | None]", await pipe.execute())
        return out

    async def drop_chunks(self, keys: list[str]) -> int:
        """:meth:`storage.base.ChunkStore.drop_chunks`: ``DEL`` each chunk (one pipeline); how many there were."""
        rkeys = [self.kv_chunk_key(k) for k in keys]
        async with unavailable("drop_chunks"):
            pipe = self.redis.pipeline(transaction=False)
            for key in rkeys:
                pipe.delete(key)
            return sum(int(n) for n in await pipe.execute()) if rkeys else 0

    async def sweep_chunks(self, grace_s: float) -> int:
        """:meth:`storage.base.ChunkStore.sweep_chunks`: remove the chunks no stored slot's manifest names
        that were untouched for ``grace_s`` seconds by Redis's clock; returns how many."""
        named = {c.key.encode("ascii") for meta in await self.list_meta() for c in meta.chunks}
        base = self._prefix + b"chunk:"
        grace_ms = max(0, round(grace_s * 1000))
        removed = 0
        async with unavailable("sweep_chunks"):
            found = [k async for k in self.redis.scan_iter(match=glob_escape(base) + b"*", count=1000)]
            unnamed = [k for k in found if k[len(base) :] not in named]
            for start in range(0, len(unnamed), _SCAN_BATCH):
                pipe = self.redis.pipeline(transaction=False)
                for key in unnamed[start : start + _SCAN_BATCH]:
                    pipe.eval(_DROP_OLD, 1, key, grace_ms)
                removed += sum(int(n) for n in await pipe.execute())
        return removed
