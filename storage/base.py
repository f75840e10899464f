"""The slot store interface and the metadata stored beside every blob.

A store keeps, per slot id, one :class:`SlotMeta` and one already-encoded (compressed) blob, written
and read together atomically. Stores never compress or interpret blobs; see
:mod:`storage.slot_codec` for that. Implementations: :class:`storage.directory.DirectoryStore`
(embedded default, one machine) and :class:`storage.redis_store.RedisStore`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Protocol, runtime_checkable

import msgspec

from storage.errors import BadStateError

__all__ = [
    "CHUNK_KEY_HEX",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PREFIX",
    "MAX_SLOT_ID_BYTES",
    "ChunkRef",
    "ChunkStore",
    "SlotMeta",
    "SlotStore",
    "decode_meta",
    "encode_meta",
    "n_chunks_for",
    "now",
    "state_bytes",
    "stored_bytes",
    "validate_chunk_key",
    "validate_slot_id",
]

DEFAULT_PREFIX = "slotserve:"
DEFAULT_CHUNK_SIZE = 64 * 1024 * 1024
"""Default chunk size in bytes (64 MiB); Redis caps a value at 512 MB."""
MAX_SLOT_ID_BYTES = 1024
CHUNK_KEY_HEX = 32
"""A KV chunk's key: 32 lowercase hex digits (an XXH3-128 digest, :func:`slotstate.kv_chunks.chunk_keys`)."""


class ChunkRef(msgspec.Struct, array_like=True, frozen=True):
    """One KV chunk of a stored slot: positions ``[p0, p1)`` of its first KV cache, stored under ``key``
    (:class:`ChunkStore`)."""

    p0: int
    p1: int
    key: str
    size: int = 0  # bytes of the stored chunk


class SlotMeta(msgspec.Struct):
    """Metadata of one stored slot.

    Attributes:
        slot_id: the slot's id (any string, see :func:`validate_slot_id`).
        model_fingerprint: identifies the model/build that produced the state; a state is only
            restorable into the same fingerprint.
        n_tokens: number of tokens in the state (== len(tokens)).
        tokens: the token ids held by the state.
        codec: codec name from :mod:`slotstate.codec` ("none", "zstd", "zstd-planes").
        level: zstd level used.
        raw_size: bytes of the SES1 blob before compression.
        stored_size: bytes of the blob as stored (after compression); set by the store on put.
        created_at: unix seconds of the first put of this slot (kept across overwrites).
        updated_at: unix seconds of the latest put; set by the store.
        n_chunks: number of pieces the stored blob is split into (1 for the directory store).
        generation: write counter, set by the store: 1 on the first put, +1 on every later put.
        digest: checksum of the SES1 blob before compression, ``"xxh3-128:<32 hex digits>"``
            (:func:`storage.slot_codec.state_digest`), checked on every load; ``""`` in metadata
            written before slotserve recorded it (such a blob is loaded unchecked).
        tenant: the tenant owning the slot (``""`` in metadata written before slots had tenants);
            ``slot_id`` is then the slot's key, ``tenant/id`` (docs/operations.md, "Tenants").
        partition: the cache partition within the tenant (a digest of the requests' ``cache_salt``,
            ``""`` without one): a cache is reused only by requests of the same tenant and partition.
        chunks: an incremental state's KV chunks in position order (:class:`ChunkRef`, stored apart in
            the :class:`ChunkStore`); empty for a state stored whole.  With chunks the blob holds the
            rest of the state (docs/operations.md, "Incremental states").
    """

    slot_id: str
    model_fingerprint: str
    n_tokens: int
    tokens: list[int]
    codec: str
    level: int
    raw_size: int
    stored_size: int
    created_at: float
    updated_at: float
    n_chunks: int = 1
    generation: int = 0
    digest: str = ""
    tenant: str = ""
    partition: str = ""
    chunks: list[ChunkRef] = []


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(SlotMeta)


def encode_meta(meta: SlotMeta) -> bytes:
    """Serialize metadata as msgpack (a map keyed by field name)."""
    return _meta_encoder.encode(meta)


def decode_meta(data: bytes | memoryview) -> SlotMeta:
    """Parse metadata written by :func:`encode_meta`.

    Raises:
        storage.errors.BadStateError: not valid msgpack or wrong fields/types.
    """
    try:
        return _meta_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BadStateError(f"corrupt slot metadata: {exc}") from exc


def validate_slot_id(slot_id: str) -> bytes:
    """Check a slot id and return its UTF-8 bytes.

    Any non-empty string is a valid id (including "/", "..", "{x}", unicode) if it is valid UTF-8
    (no lone surrogates) and at most :data:`MAX_SLOT_ID_BYTES` bytes long.

    Raises:
        TypeError: not a str.
        ValueError: empty, not encodable as UTF-8, or too long.
    """
    if not isinstance(slot_id, str):
        raise TypeError(f"slot id must be str, not {type(slot_id).__name__}")
    if not slot_id:
        raise ValueError("slot id must not be empty")
    try:
        raw = slot_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"slot id is not valid UTF-8: {exc}") from exc
    if len(raw) > MAX_SLOT_ID_BYTES:
        raise ValueError(f"slot id is {len(raw)} bytes long; the limit is {MAX_SLOT_ID_BYTES}")
    return raw


def stored_bytes(meta: SlotMeta) -> int:
    """Bytes a stored slot takes in the store: its blob and, for an incremental state, its chunks (each counted
    whole, even where other slots share it)."""
    return meta.stored_size + sum(c.size for c in meta.chunks)


def state_bytes(meta: SlotMeta) -> int:
    """Bytes of a stored slot's state before compression: the blob's and, for an incremental state, its chunks'
    (stored uncompressed: f16 KV compresses 1.1-1.2x)."""
    return meta.raw_size + sum(c.size for c in meta.chunks)


def validate_chunk_key(key: str) -> str:
    """``key`` when it is :data:`CHUNK_KEY_HEX` lowercase hex digits; ValueError otherwise (so a key can
    name a file or a Redis key as it is)."""
    if not isinstance(key, str) or len(key) != CHUNK_KEY_HEX or key.strip("0123456789abcdef"):
        raise ValueError(f"not a chunk key: {key!r}")
    return key


def n_chunks_for(size: int, chunk_size: int) -> int:
    """Number of chunks of at most ``chunk_size`` bytes for ``size`` bytes (at least 1, even for 0)."""
    return max(1, -(-size // chunk_size))


def now() -> float:
    """Current wall-clock time in unix seconds."""
    return time.time()


@runtime_checkable
class SlotStore(Protocol):
    """What every slot store provides. All methods are coroutines; backend outages raise
    :class:`storage.errors.StoreUnavailableError`, corrupt stored data raises
    :class:`storage.errors.BadStateError`, invalid slot ids raise ``ValueError``/``TypeError``.

    Constructor options shared by implementations: ``prefix`` (key prefix, default "slotserve:"),
    ``ttl_s`` (optional time to live of slot data in seconds, refreshed on every put; expired slots
    read as absent), ``chunk_size`` (bytes per stored piece, default 64 MiB).
    """

    async def put(
        self,
        meta: SlotMeta,
        blob: bytes | memoryview,
        *,
        lease: str | None = None,
        ready: Awaitable[object] | None = None,
    ) -> SlotMeta:
        """Store an already-encoded blob and its metadata atomically, replacing any previous version.

        A concurrent reader sees either the old pair or the new pair, never a mix or a partial blob.
        The store fills ``stored_size`` (len(blob)), ``n_chunks``, ``generation`` (previous + 1, or 1),
        ``created_at`` (kept from the previous version; else ``meta.created_at`` if > 0, else now) and
        ``updated_at`` (now). Returns the metadata as stored.

        ``lease``: a fencing token from :meth:`acquire_lease`. When given, the write is committed only
        if that token holds the slot's lease at the moment of the commit, checked in the same atomic
        step; otherwise nothing is written and :class:`storage.errors.LeaseLostError` is raised.

        ``ready``: what must be done before the commit point (the KV chunks the metadata names being
        written, :meth:`ChunkStore.put_chunks`): the store may prepare the write meanwhile and commits only
        once ``ready`` is done; if it raises, nothing is committed and its exception propagates.
        """
        ...

    async def get(self, slot_id: str) -> tuple[SlotMeta, bytes] | None:
        """Return ``(meta, encoded_blob)`` or None if absent/expired.

        Raises BadStateError if the stored blob is incomplete (missing chunk, wrong length) or the
        metadata is unreadable.
        """
        ...

    async def get_meta(self, slot_id: str) -> SlotMeta | None:
        """Return the metadata only (cheap: the blob is not read), or None if absent/expired."""
        ...

    async def delete(self, slot_id: str, *, lease: str | None = None) -> bool:
        """Remove a slot; True if it existed. ``lease`` fences it as in :meth:`put`
        (:class:`storage.errors.LeaseLostError`, nothing removed)."""
        ...

    async def list_meta(self) -> list[SlotMeta]:
        """Metadata of every stored (unexpired) slot, in no particular order."""
        ...

    async def ping(self) -> None:
        """Check the backend is usable; raises StoreUnavailableError if not."""
        ...

    async def close(self) -> None:
        """Release connections/resources. The store is unusable afterwards."""
        ...

    async def acquire_lease(self, slot_id: str, owner: str, ttl_ms: int) -> str | None:
        """Take the ownership lease of a slot for ``ttl_ms`` milliseconds.

        Returns a token (needed to renew/release) on success, or None if another owner holds an
        unexpired lease. If ``owner`` already holds it, its TTL is reset and the same token returned.
        """
        ...

    async def renew_lease(self, slot_id: str, token: str, ttl_ms: int) -> bool:
        """Reset the lease TTL to ``ttl_ms`` if ``token`` still holds it; False otherwise."""
        ...

    async def release_lease(self, slot_id: str, token: str) -> bool:
        """Drop the lease if ``token`` still holds it; False otherwise."""
        ...

    async def lease_owner(self, slot_id: str) -> str | None:
        """The owner of the unexpired lease of a slot, or None."""
        ...


@runtime_checkable
class ChunkStore(Protocol):
    """A store of KV chunks beside the slots (:class:`SlotStore`): content-addressed, written once, shared
    by every slot whose manifest (:attr:`SlotMeta.chunks`) names them.  Keys: :func:`validate_chunk_key`
    (ValueError otherwise); values: bytes as given (sealed by :func:`slotstate.kv_chunks.seal`).  Outages
    raise :class:`storage.errors.StoreUnavailableError`.

    A turn writes its new chunks first and then its slot's metadata (the commit point, fenced by the
    lease); chunks no stored slot names are removed by :meth:`sweep_chunks` once untouched for
    ``grace_s`` seconds, so a chunk written or found (:meth:`has_chunks` touches it) for a commit still
    in flight is kept.
    """

    async def put_chunks(self, chunks: dict[str, bytes]) -> int:
        """Store each ``key -> value`` that is not stored yet (one present is only touched); returns the
        bytes written."""
        ...

    async def has_chunks(self, keys: list[str]) -> list[int]:
        """Each key's stored size in bytes, -1 where it is not stored; a stored one is touched (kept from the
        sweep for its grace)."""
        ...

    async def get_chunks(self, keys: list[str], nbytes: int = 0) -> list[bytes | None]:
        """Each key's value, None where it is not stored.  ``nbytes``: the chunks' total stored size when
        the caller knows it (a manifest's :attr:`ChunkRef.size`), so a deadline can scale with it."""
        ...

    async def drop_chunks(self, keys: list[str]) -> int:
        """Remove the chunks ``keys`` (found damaged: a chunk is written once, so a damaged one would stay
        damaged and be found by every later save of its key); returns how many were stored."""
        ...

    async def sweep_chunks(self, grace_s: float) -> int:
        """Remove the chunks no stored slot names that were untouched for ``grace_s`` seconds; returns
        how many."""
        ...
