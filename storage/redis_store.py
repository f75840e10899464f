"""RedisStore: slot store on Redis (standalone, Sentinel or Cluster; see :mod:`storage.redis_url`).

Keys (``P`` = prefix, ``T`` = the slot id with ``%``, ``{`` and ``}`` percent-escaped, so the
``{T}`` hash tag puts every key of one slot in the same cluster slot)::

    P slot:{T}:meta             hash: gen, n (chunks), created (unix s), body (msgpack SlotMeta)
    P slot:{T}:blob:<gen>:<i>   chunk i (0-based) of generation <gen>'s blob, chunk_size bytes each
    P slot:{T}:tmp:<nonce>:<i>  chunks of a put in progress (expire after 10 min if never committed)
    P slot:{T}:lease            lease token (SET NX PX)
    P chunk:K                   KV chunk K of incremental states, shared by slots (:mod:`storage.redis_chunks`)

Atomic put: (1) the chunks are written, pipelined, to fresh ``tmp`` keys; (2) one Lua script checks
they all exist and, for a fenced put (``lease=token``), that the lease key holds exactly that token
(else it drops the tmp keys and refuses: :class:`storage.errors.LeaseLostError`), reads the current
generation, deletes that generation's chunks, RENAMEs the tmp keys
to ``blob:<gen+1>:<i>``, writes the meta hash and applies the TTL (or PERSIST) to every key. Scripts
run atomically, so meta and chunks switch together. The ``gen``, ``n`` and ``created`` hash fields are
authoritative (the script sets them); they override those fields of ``body`` when read.

Consistent get: read the meta hash, then one pipeline of GET per chunk followed by a second read of the
meta. If the meta changed in between (a concurrent put/delete), retry after a short random pause; if
it did not, chunk keys of that generation cannot have been touched, so a missing chunk or a wrong total
length is real damage (BadStateError). After a few lost races (a slot rewritten faster than it can be
read) a Lua script reads meta and chunks atomically instead; that always succeeds but briefly needs
about one extra blob's worth of memory inside Redis. A blob is reassembled with one copy.

All redis/socket errors that mean "cannot reach Redis now" become StoreUnavailableError.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Awaitable
from typing import Any, cast

import msgspec
from redis import exceptions as rexc

from storage.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PREFIX,
    SlotMeta,
    decode_meta,
    encode_meta,
    n_chunks_for,
    now,
    validate_slot_id,
)
from storage.errors import BadStateError, LeaseLostError, StoreUnavailableError
from storage.leases import check_ttl_ms, make_token, token_owner
from storage.redis_chunks import RedisChunks
from storage.redis_url import UNAVAILABLE, Connection, connect, glob_escape, unavailable

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

_TMP_TTL_MS = 10 * 60 * 1000
_OPTIMISTIC_READS = 4
_LIST_BATCH = 256


# KEYS[1]=meta, KEYS[2]=lease, KEYS[3..n+2]=tmp chunks; ARGV: blob key base, body, n, ttl_ms, created,
# fencing token ('' = unfenced)
_COMMIT = """
local n = tonumber(ARGV[3])
if ARGV[6] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[6] then
  for i = 1, n do redis.call('DEL', KEYS[i + 2]) end
  return {-2, ''}
end
for i = 1, n do
  if redis.call('EXISTS', KEYS[i + 2]) == 0 then return {-1, ''} end
end
local old = redis.call('HMGET', KEYS[1], 'gen', 'n', 'created')
local gen = 1
local created = ARGV[5]
if old[1] then
  local og = tonumber(old[1])
  gen = og + 1
  if old[3] then created = old[3] end
  for i = 0, tonumber(old[2]) - 1 do
    redis.call('DEL', ARGV[1] .. old[1] .. ':' .. i)
  end
end
local ttl = tonumber(ARGV[4])
for i = 1, n do
  local dst = ARGV[1] .. gen .. ':' .. (i - 1)
  redis.call('RENAME', KEYS[i + 2], dst)
  if ttl > 0 then redis.call('PEXPIRE', dst, ttl) else redis.call('PERSIST', dst) end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'gen', gen, 'n', n, 'created', created, 'body', ARGV[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return {gen, created}
"""

# KEYS[1]=meta, KEYS[2]=lease; ARGV[1]=blob key base, ARGV[2]=fencing token ('' = unfenced)
_DELETE = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then return -1 end
local old = redis.call('HMGET', KEYS[1], 'gen', 'n')
if not old[1] then return 0 end
for i = 0, tonumber(old[2]) - 1 do
  redis.call('DEL', ARGV[1] .. old[1] .. ':' .. i)
end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS[1]=meta; ARGV[1]=blob key base -> false, or {gen, n, created, body, chunk0, chunk1, ...}
_READ_ATOMIC = """
local h = redis.call('HMGET', KEYS[1], 'gen', 'n', 'created', 'body')
if not h[1] then return false end
local out = {h[1], h[2], h[3], h[4]}
for i = 0, tonumber(h[2]) - 1 do
  out[#out + 1] = redis.call('GET', ARGV[1] .. h[1] .. ':' .. i)
end
return out
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def escape_tag(raw: bytes) -> bytes:
    """``raw`` with ``%``, ``{`` and ``}`` percent-escaped, so it can sit inside a Redis Cluster hash tag."""
    return raw.replace(b"%", b"%25").replace(b"{", b"%7B").replace(b"}", b"%7D")


class RedisStore(RedisChunks):
    """Slot store on Redis, with KV chunks (:class:`storage.redis_chunks.RedisChunks`); build it with
    :meth:`from_url`. See the module docstring for keys and atomicity.

    Args:
        conn: a :class:`storage.redis_url.Connection` (or use :meth:`from_url`).
        prefix: key prefix (default "slotserve:"). Must not contain ``{`` or ``}`` (it would break the
            per-slot hash tag).
        ttl_s: optional time to live of slot data in seconds (float, ms resolution), reset by each put
            on the meta and every chunk.
        chunk_size: maximum bytes per chunk key (default 64 MiB; Redis caps values at 512 MB).
    """

    def __init__(
        self,
        conn: Connection,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError("prefix must not contain '{' or '}'")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be positive or None")
        if not 1 <= chunk_size <= 512 * 1024 * 1024:
            raise ValueError("chunk_size must be between 1 byte and 512 MiB")
        self.conn = conn
        self.redis = conn.client
        self.prefix = prefix
        self._prefix = prefix.encode("utf-8")
        self.ttl_s = ttl_s
        self._ttl_ms = max(1, round(ttl_s * 1000)) if ttl_s else 0
        self.chunk_size = chunk_size
        self._commit = self.redis.register_script(_COMMIT)
        self._delete = self.redis.register_script(_DELETE)
        self._read_atomic = self.redis.register_script(_READ_ATOMIC)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        retries: int = 2,
        **client_kwargs: Any,
    ) -> RedisStore:
        """Create a store for ``url`` (``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``,
        ``redis+cluster://``; see :mod:`storage.redis_url`). Connects lazily: call :meth:`ping` to check.

        Raises:
            ValueError: malformed URL or options.
        """
        conn = connect(
            url,
            socket_timeout=socket_timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            **client_kwargs,
        )
        return cls(conn, prefix=prefix, ttl_s=ttl_s, chunk_size=chunk_size)

    # -- keys ---------------------------------------------------------------------------------------

    def _base(self, slot_id: str) -> bytes:
        return self._prefix + b"slot:{" + escape_tag(validate_slot_id(slot_id)) + b"}:"

    def meta_key(self, slot_id: str) -> bytes:
        """Key of a slot's meta hash."""
        return self._base(slot_id) + b"meta"

    def chunk_key(self, slot_id: str, generation: int, index: int) -> bytes:
        """Key of chunk ``index`` of generation ``generation`` of a slot."""
        return self._base(slot_id) + b"blob:%d:%d" % (generation, index)

    def lease_key(self, slot_id: str) -> bytes:
        """Key of a slot's lease."""
        return self._base(slot_id) + b"lease"

    # -- meta -------------------------------------------------------------------------------------

    @staticmethod
    def _meta_from(fields: list[bytes | None]) -> SlotMeta | None:
        gen, n, created, body = fields
        if gen is None:
            return None
        if n is None or created is None or body is None:
            raise BadStateError("incomplete slot meta hash")
        try:
            return msgspec.structs.replace(
                decode_meta(body), generation=int(gen), n_chunks=int(n), created_at=float(created)
            )
        except ValueError as exc:
            if isinstance(exc, BadStateError):
                raise
            raise BadStateError(f"corrupt slot meta hash: {exc}") from exc

    # -- store API --------------------------------------------------------------------------------

    async def put(
        self,
        meta: SlotMeta,
        blob: bytes | memoryview,
        *,
        lease: str | None = None,
        ready: Awaitable[object] | None = None,
    ) -> SlotMeta:
        """Store ``blob`` (already encoded) and ``meta`` atomically, fenced by ``lease`` if given; see
        SlotStore.put and the module doc (LeaseLostError: refused, nothing stored).  With ``ready`` the blob's
        temporary keys are written while it runs; the commit script runs once it is done."""
        base = self._base(meta.slot_id)
        view = memoryview(blob).cast("B")
        n = n_chunks_for(len(view), self.chunk_size)
        nonce = secrets.token_hex(8).encode()
        tmp_keys = [base + b"tmp:%s:%d" % (nonce, i) for i in range(n)]
        t = now()
        created = meta.created_at if meta.created_at > 0 else t
        body = msgspec.structs.replace(meta, stored_size=len(view), n_chunks=n, updated_at=t, created_at=created)
        async with unavailable("put"):
            try:
                pipe = self.redis.pipeline(transaction=False)
                for i, key in enumerate(tmp_keys):
                    pipe.set(key, view[i * self.chunk_size : (i + 1) * self.chunk_size], px=_TMP_TTL_MS)
                await pipe.execute()
                if ready is not None:
                    await ready
                gen, created_s = await self._commit(
                    keys=[base + b"meta", base + b"lease", *tmp_keys],
                    args=[base + b"blob:", encode_meta(body), n, self._ttl_ms, repr(created), lease or ""],
                )
            except UNAVAILABLE:
                raise  # cannot clean up now; the tmp keys expire by themselves
            except BaseException:
                await self._drop_tmp(tmp_keys)
                raise
        if int(gen) == -2:
            raise LeaseLostError(meta.slot_id)
        if int(gen) < 0:
            raise StoreUnavailableError("temporary chunks vanished before commit (evicted or expired)")
        return msgspec.structs.replace(body, generation=int(gen), created_at=float(created_s))

    async def _drop_tmp(self, keys: list[bytes]) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key)
            await pipe.execute()
        except (rexc.RedisError, OSError) as exc:  # best effort: tmp keys expire on their own
            log.debug("could not drop temporary chunks: %r", exc)

    async def _read_meta(self, meta_key: bytes) -> SlotMeta | None:
        fields = cast("list[bytes | None]", await self.redis.hmget(meta_key, ["gen", "n", "created", "body"]))
        return self._meta_from(fields)

    @staticmethod
    def _assemble(slot_id: str, meta: SlotMeta, chunks: list[bytes | None]) -> tuple[SlotMeta, bytes]:
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise BadStateError(f"slot {slot_id!r} generation {meta.generation}: chunks {missing} missing")
        blob = b"".join(chunks)  # type: ignore[arg-type]
        if len(blob) != meta.stored_size:
            raise BadStateError(f"slot {slot_id!r}: blob is {len(blob)} bytes, meta says {meta.stored_size}")
        return meta, blob

    async def get(self, slot_id: str) -> tuple[SlotMeta, bytes] | None:
        """``(meta, encoded_blob)`` or None; BadStateError on a missing chunk or wrong blob length."""
        base = self._base(slot_id)
        meta_key = base + b"meta"
        fields_cmd = ["gen", "n", "created", "body"]
        async with unavailable("get"):
            for attempt in range(_OPTIMISTIC_READS):
                if attempt:
                    await asyncio.sleep(random.uniform(0, 0.002 * 2**attempt))
                fields = cast("list[bytes | None]", await self.redis.hmget(meta_key, fields_cmd))
                meta = self._meta_from(fields)
                if meta is None:
                    return None
                pipe = self.redis.pipeline(transaction=False)
                for i in range(meta.n_chunks):
                    pipe.get(base + b"blob:%d:%d" % (meta.generation, i))
                pipe.hmget(meta_key, fields_cmd)
                *chunks, after = await pipe.execute()
                if after == fields:
                    return self._assemble(slot_id, meta, chunks)
            # lost every race against writers: read meta and chunks in one atomic script
            reply = await self._read_atomic(keys=[meta_key], args=[base + b"blob:"])
            if reply is None:
                return None
            meta = self._meta_from(reply[:4])
            assert meta is not None
            return self._assemble(slot_id, meta, reply[4:])

    async def get_meta(self, slot_id: str) -> SlotMeta | None:
        """Metadata only (one HMGET), or None if absent/expired."""
        meta_key = self.meta_key(slot_id)
        async with unavailable("get_meta"):
            return await self._read_meta(meta_key)

    async def delete(self, slot_id: str, *, lease: str | None = None) -> bool:
        """Delete meta and chunks atomically (Lua), fenced by ``lease`` if given (LeaseLostError); True if
        the slot existed."""
        base = self._base(slot_id)
        async with unavailable("delete"):
            done = await self._delete(keys=[base + b"meta", base + b"lease"], args=[base + b"blob:", lease or ""])
        if done == -1:
            raise LeaseLostError(slot_id)
        return bool(done)

    async def list_meta(self) -> list[SlotMeta]:
        """SCAN for meta keys under the prefix (all cluster nodes) and read them in batches.

        Metas that vanish or are unreadable are skipped.
        """
        pattern = glob_escape(self._prefix) + b"slot:{*}:meta"
        out: list[SlotMeta] = []
        async with unavailable("list_meta"):
            keys = [k async for k in self.redis.scan_iter(match=pattern, count=1000)]
            for start in range(0, len(keys), _LIST_BATCH):
                pipe = self.redis.pipeline(transaction=False)
                for key in keys[start : start + _LIST_BATCH]:
                    pipe.hmget(key, ["gen", "n", "created", "body"])
                for fields in await pipe.execute(raise_on_error=False):
                    if isinstance(fields, Exception):
                        continue
                    try:
                        meta = self._meta_from(fields)
                    except BadStateError:
                        continue
                    if meta is not None:
                        out.append(meta)
        return out

    async def ping(self) -> None:
        """PING Redis; StoreUnavailableError if it does not answer."""
        async with unavailable("ping"):
            await self.redis.ping()

    async def close(self) -> None:
        """Close the connection pool (and sentinel clients)."""
        await self.conn.aclose()

    # -- leases -----------------------------------------------------------------------------------

    async def acquire_lease(self, slot_id: str, owner: str, ttl_ms: int) -> str | None:
        """``SET lease token NX PX ttl``; if held by the same owner, renew and return its token."""
        key = self.lease_key(slot_id)
        check_ttl_ms(ttl_ms)
        token = make_token(owner)
        async with unavailable("acquire_lease"):
            if await self.redis.set(key, token, nx=True, px=ttl_ms):
                return token
            current = cast("bytes | None", await self.redis.get(key))  # no decode_responses: bytes
            if current is None:
                # expired between the two commands: one more plain attempt
                return token if await self.redis.set(key, token, nx=True, px=ttl_ms) else None
            held = current.decode("utf-8", "replace")
            if token_owner(held) == owner and await self._renew(keys=[key], args=[current, ttl_ms]):
                return held
            return None

    async def renew_lease(self, slot_id: str, token: str, ttl_ms: int) -> bool:
        """PEXPIRE the lease if ``token`` holds it (Lua, token-checked)."""
        key = self.lease_key(slot_id)
        check_ttl_ms(ttl_ms)
        async with unavailable("renew_lease"):
            return bool(await self._renew(keys=[key], args=[token, ttl_ms]))

    async def release_lease(self, slot_id: str, token: str) -> bool:
        """DEL the lease if ``token`` holds it (Lua, token-checked)."""
        key = self.lease_key(slot_id)
        async with unavailable("release_lease"):
            return bool(await self._release(keys=[key], args=[token]))

    async def lease_owner(self, slot_id: str) -> str | None:
        """Owner part of the current lease token, or None."""
        key = self.lease_key(slot_id)
        async with unavailable("lease_owner"):
            current = cast("bytes | None", await self.redis.get(key))  # no decode_responses: bytes
        return None if current is None else token_owner(current.decode("utf-8", "replace"))
