"""Save and load SES1 slot states through a store, compressing and checking them.

A state is stored whole (:func:`save_slot`) or incrementally (:func:`save_chunks`): its first KV cache as
KV chunks in the store's :class:`storage.base.ChunkStore` (:mod:`slotstate.kv_chunks`), named in order by
the metadata (:attr:`storage.base.SlotMeta.chunks`), and the rest of the state (a sliding-window model's
sliding cache, bounded by its window) as the blob.  :func:`load_slot` gives back the SES1 blob either way.

``save_slot`` compresses a SES1 blob (in a worker thread) and stores it with its metadata, which
records the blob's checksum (:func:`state_digest`, XXH3-128 from the ``xxhash`` package); ``load_slot``
fetches, refuses a foreign model fingerprint, decompresses and checks the result (size, tokens and that
checksum, whatever the codec: ``"none"`` has no checksum of its own, and zstd's frame checksum covers the
compressed planes rather than the SES1 blob) before handing it back.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Sequence

import numpy as np
import xxhash

from slotstate import codec as codecs
from slotstate import kv_chunks
from slotstate.errors import BadStateError as StateFormatError
from slotstate.seq_state import IO_MAGIC
from slotstate.ses1 import ses1_header, ses1_tokens
from storage.base import ChunkRef, ChunkStore, SlotMeta, SlotStore
from storage.errors import BadStateError, FingerprintMismatchError

__all__ = ["DIGEST_ALGORITHM", "load_slot", "manifest_digest", "save_chunks", "save_slot", "state_digest"]

DIGEST_ALGORITHM = "xxh3-128"


def state_digest(blob: bytes | bytearray | memoryview) -> str:
    """``"xxh3-128:<32 lowercase hex digits>"``: XXH3's 128-bit hash (https://xxhash.com) of ``blob``.

    Not a cryptographic hash: it detects damage (bit flips, truncation), not forgery.  About
    10 GB/s here, so it costs well under 1% of a zstd compression of the same bytes.
    """
    return f"{DIGEST_ALGORITHM}:{xxhash.xxh3_128_hexdigest(blob)}"


def _encode(blob: bytes | memoryview, codec: str, level: int) -> tuple[str, bytes, str]:
    if codec == "auto":
        used, data = codecs.encode_auto(blob, level)
    elif codec == "best":
        used, data = codecs.encode_best(blob, level)
    else:
        used, data = codec, codecs.encode(blob, codec, level)
    return used, data, state_digest(blob)


async def save_slot(
    store: SlotStore,
    slot_id: str,
    fingerprint: str,
    tokens: Sequence[int],
    ses1_blob: bytes | memoryview,
    codec: str = "auto",
    level: int = codecs.DEFAULT_LEVEL,
    *,
    lease: str | None = None,
    tenant: str = "",
    partition: str = "",
) -> SlotMeta:
    """Compress ``ses1_blob`` and store it under ``slot_id`` with its metadata.

    Args:
        store: any :class:`storage.base.SlotStore`.
        fingerprint: the model fingerprint the state belongs to.
        tokens: the slot's tokens; must equal the tokens inside ``ses1_blob``.
        ses1_blob: a SES1 blob (see :mod:`slotstate.ses1`).
        codec: "auto" (sampled planes-or-plain choice, :func:`slotstate.codec.encode_auto`), "best"
            (both, keep the smaller), or a codec name from :data:`slotstate.codec.CODECS`.
        level: zstd level.
        lease: a fencing token (:meth:`storage.base.SlotStore.put`): stored only while it holds the
            slot's lease.
        tenant: the slot's owner, kept in the metadata (:attr:`storage.base.SlotMeta.tenant`).
        partition: its cache partition (:attr:`storage.base.SlotMeta.partition`).

    Returns:
        The metadata as stored (generation etc. filled in by the store).

    Raises:
        BadStateError: ``ses1_blob`` is not a valid SES1 blob or its tokens differ from ``tokens``.
        ValueError: unknown codec or invalid slot id.
        StoreUnavailableError: the store is unreachable.
        LeaseLostError: ``lease`` does not hold the slot's lease (nothing stored).
    """
    tokens = list(tokens)
    if ses1_tokens(ses1_blob) != tokens:
        raise BadStateError("the SES1 blob's tokens differ from the slot's tokens")
    _check_codec(codec)
    used, data, digest = await asyncio.to_thread(_encode, ses1_blob, codec, level)
    raw_size = len(memoryview(ses1_blob).cast("B"))
    meta = _meta(slot_id, fingerprint, tokens, used, level, raw_size, len(data), digest, tenant, partition)
    return await store.put(meta, data, lease=lease)


def _check_codec(codec: str) -> None:
    if codec not in (*codecs.CODECS, "auto", "best"):
        raise ValueError(f"unknown codec {codec!r}")


def _meta(
    slot_id: str, fingerprint: str, tokens: list[int], codec: str, level: int, raw_size: int, stored_size: int,
    digest: str, tenant: str, partition: str, chunks: Sequence[ChunkRef] = (),
) -> SlotMeta:  # fmt: skip
    """The metadata a save stores (the store fills in generation and times)."""
    return SlotMeta(
        slot_id=slot_id, model_fingerprint=fingerprint, n_tokens=len(tokens), tokens=tokens, codec=codec,
        level=level, raw_size=raw_size, stored_size=stored_size, created_at=0.0, updated_at=0.0, digest=digest,
        tenant=tenant, partition=partition, chunks=list(chunks),
    )  # fmt: skip


def manifest_digest(chunks: Sequence[ChunkRef], rest: bytes | bytearray | memoryview) -> str:
    """The :attr:`~storage.base.SlotMeta.digest` of an incremental state: ``"xxh3-128:<hex>"`` over its
    chunks' ranges and keys and the rest's bytes (each chunk carries its own checksum:
    :func:`slotstate.kv_chunks.seal`)."""
    h = xxhash.xxh3_128()
    for c in chunks:
        h.update(struct.pack("<ii", c.p0, c.p1) + c.key.encode("ascii"))
    h.update(rest)
    return f"{DIGEST_ALGORITHM}:{h.hexdigest()}"


async def save_chunks(
    store: SlotStore,
    slot_id: str,
    fingerprint: str,
    tokens: Sequence[int],
    chunks: Sequence[ChunkRef],
    new: dict[str, bytes],
    rest: bytes | bytearray | memoryview,
    codec: str = "auto",
    level: int = codecs.DEFAULT_LEVEL,
    *,
    lease: str | None = None,
    tenant: str = "",
    partition: str = "",
    ready: Awaitable[object] | None = None,
) -> tuple[SlotMeta, int]:
    """Store an incremental state: the chunks of ``new`` (key -> sealed record) the store lacks first,
    then the metadata naming ``chunks`` (the state's first KV cache, in position order) with ``rest``
    (the one-stream state's bytes after that cache's record: ``u32 1 | record`` per further KV cache;
    empty for one cache) compressed as the blob: that write is the commit point, fenced by ``lease`` as
    :func:`save_slot`'s, and made once ``ready`` (chunk writes in flight, written ahead) is done too
    (:meth:`storage.base.SlotStore.put`).  Returns the stored metadata and the chunk bytes written (of
    ``new``).

    Raises ValueError (a store without chunks, an unknown codec, a malformed key), StoreUnavailableError,
    LeaseLostError (nothing committed; chunks written stay until swept).
    """
    if not isinstance(store, ChunkStore):
        raise ValueError("this store keeps no KV chunks")
    _check_codec(codec)
    written = await store.put_chunks(new) if new else 0
    used, data = "none", b""  # no rest (one KV cache): nothing to compress
    if len(rest):
        used, data, _ = await asyncio.to_thread(_encode, memoryview(rest), codec, level)
    raw_size, digest, ids = len(memoryview(rest).cast("B")), manifest_digest(chunks, rest), list(tokens)
    meta = _meta(slot_id, fingerprint, ids, used, level, raw_size, len(data), digest, tenant, partition, chunks)
    return await store.put(meta, data, lease=lease, ready=ready), written


def _chunk_record(slot_id: str, ref: ChunkRef, value: bytes) -> memoryview:
    """The llama.cpp record in the stored ``value`` of chunk ``ref``; BadStateError when it is damaged, another
    key's or holds other positions than its range."""
    try:
        record = kv_chunks.unseal(value, ref.key)
        got = kv_chunks.parse_record(record).positions
    except StateFormatError as exc:
        raise BadStateError(f"slot {slot_id!r}: KV chunk {ref.key}: {exc}") from exc
    if not np.array_equal(got, np.arange(ref.p0, ref.p1)):
        raise BadStateError(f"slot {slot_id!r}: KV chunk {ref.key} holds other positions than {ref.p0}-{ref.p1}")
    return record


def _damaged(meta: SlotMeta, values: list[bytes | None]) -> list[str]:
    """The keys of the stored chunks of ``meta`` whose values are damaged (:func:`_chunk_record`)."""
    out = []
    for ref, value in zip(meta.chunks, values, strict=True):
        try:
            if value is not None:
                _chunk_record(meta.slot_id, ref, value)
        except BadStateError:
            out.append(ref.key)
    return out


def _assemble(meta: SlotMeta, rest: bytes, values: list[bytes | None]) -> bytearray:
    """The SES1 blob of an incremental state from its rest and its chunks' stored values (checked)."""
    bounds = [(c.p0, c.p1) for c in meta.chunks]
    if [b[0] for b in bounds] != [0, *(b[1] for b in bounds[:-1])] or bounds[-1][1] != meta.n_tokens:
        raise BadStateError(f"slot {meta.slot_id!r}: its KV chunks do not cover positions 0-{meta.n_tokens}")
    records = []
    for ref, value in zip(meta.chunks, values, strict=True):
        if value is None:
            raise BadStateError(f"slot {meta.slot_id!r}: KV chunk {ref.key} of positions {ref.p0}-{ref.p1} is missing")
        records.append(_chunk_record(meta.slot_id, ref, value))
    head = ses1_header(meta.tokens) + struct.pack("<IiI", IO_MAGIC, 0, 1)
    try:  # the SES1 blob written once: headers, the joined record, the rest
        return kv_chunks.join_records(records, before=head, after=rest)
    except StateFormatError as exc:
        raise BadStateError(f"slot {meta.slot_id!r}: {exc}") from exc


def _decode_checked(meta: SlotMeta, data: bytes) -> bytes:
    raw = codecs.decode(data, meta.codec)
    if len(raw) != meta.raw_size:
        raise BadStateError(f"slot {meta.slot_id!r}: decoded {len(raw)} bytes, meta says {meta.raw_size}")
    if meta.chunks:
        if manifest_digest(meta.chunks, raw) != meta.digest:
            raise BadStateError(f"slot {meta.slot_id!r}: the state's checksum differs from the metadata's (damaged)")
        return raw  # the rest: assembled with the chunks by load_slot
    if meta.digest and state_digest(raw) != meta.digest:
        raise BadStateError(f"slot {meta.slot_id!r}: the state's checksum differs from the metadata's (damaged)")
    tokens = ses1_tokens(raw)
    if tokens != meta.tokens or len(tokens) != meta.n_tokens:
        raise BadStateError(f"slot {meta.slot_id!r}: the state's tokens differ from the metadata's")
    return raw


async def load_slot(store: SlotStore, slot_id: str, fingerprint: str) -> tuple[SlotMeta, bytes | bytearray] | None:
    """Fetch, verify and decompress a slot's state.

    Returns:
        ``(meta, ses1_blob)``, or None if the slot is not stored (or expired).

    Raises:
        FingerprintMismatchError: the slot was saved for another model fingerprint (nothing is decoded
            or returned).
        BadStateError: damaged blob: corrupt compressed data, size mismatch, a checksum that differs
            from the metadata's :attr:`~storage.base.SlotMeta.digest`, invalid SES1 header, or tokens that
            differ from the metadata; for an incremental state also a KV chunk missing, damaged (its own
            checksum) or holding other positions than its range (a damaged chunk is removed from the store:
            :meth:`storage.base.ChunkStore.drop_chunks`).
        StoreUnavailableError: the store is unreachable.
    """
    got = await store.get(slot_id)
    if got is None:
        return None
    meta, data = got
    if meta.model_fingerprint != fingerprint:
        raise FingerprintMismatchError(slot_id, fingerprint, meta.model_fingerprint)
    raw = await asyncio.to_thread(_decode_checked, meta, data)
    if meta.chunks:
        if not isinstance(store, ChunkStore):
            raise BadStateError(f"slot {meta.slot_id!r} is stored in KV chunks, which this store does not keep")
        values = await store.get_chunks([c.key for c in meta.chunks], sum(c.size for c in meta.chunks))
        try:
            return meta, await asyncio.to_thread(_assemble, meta, raw, values)
        except BadStateError:
            # a damaged chunk stays damaged (chunks are written once): removed, so the next save that names
            # its key (the slot rebuilt by a re-prefill) writes it anew instead of finding it stored
            damaged = await asyncio.to_thread(_damaged, meta, values)
            if damaged:
                await store.drop_chunks(damaged)
            raise
    return meta, raw
