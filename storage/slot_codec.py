"""Save and load SES1 slot states through a store, compressing and checking them.

``save_slot`` compresses a SES1 blob (in a worker thread) and stores it with its metadata, which
records the blob's checksum (:func:`state_digest`, XXH3-128 from the ``xxhash`` package); ``load_slot``
fetches, refuses a foreign model fingerprint, decompresses and checks the result (size, tokens and that
checksum, whatever the codec: ``"none"`` has no checksum of its own, and zstd's frame checksum covers the
compressed planes rather than the SES1 blob) before handing it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import xxhash

from slotstate import codec as codecs
from slotstate.ses1 import ses1_tokens
from storage.base import SlotMeta, SlotStore
from storage.errors import BadStateError, FingerprintMismatchError

__all__ = ["DIGEST_ALGORITHM", "load_slot", "save_slot", "state_digest"]

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
    if codec not in (*codecs.CODECS, "auto", "best"):
        raise ValueError(f"unknown codec {codec!r}")
    used, data, digest = await asyncio.to_thread(_encode, ses1_blob, codec, level)
    meta = SlotMeta(
        slot_id=slot_id,
        model_fingerprint=fingerprint,
        n_tokens=len(tokens),
        tokens=tokens,
        codec=used,
        level=level,
        raw_size=len(memoryview(ses1_blob).cast("B")),
        stored_size=len(data),
        created_at=0.0,
        updated_at=0.0,
        digest=digest,
    )
    return await store.put(meta, data, lease=lease)


def _decode_checked(meta: SlotMeta, data: bytes) -> bytes:
    raw = codecs.decode(data, meta.codec)
    if len(raw) != meta.raw_size:
        raise BadStateError(f"slot {meta.slot_id!r}: decoded {len(raw)} bytes, meta says {meta.raw_size}")
    if meta.digest and state_digest(raw) != meta.digest:
        raise BadStateError(f"slot {meta.slot_id!r}: the state's checksum differs from the metadata's (damaged)")
    tokens = ses1_tokens(raw)
    if tokens != meta.tokens or len(tokens) != meta.n_tokens:
        raise BadStateError(f"slot {meta.slot_id!r}: the state's tokens differ from the metadata's")
    return raw


async def load_slot(store: SlotStore, slot_id: str, fingerprint: str) -> tuple[SlotMeta, bytes] | None:
    """Fetch, verify and decompress a slot's state.

    Returns:
        ``(meta, ses1_blob)``, or None if the slot is not stored (or expired).

    Raises:
        FingerprintMismatchError: the slot was saved for another model fingerprint (nothing is decoded
            or returned).
        BadStateError: damaged blob: corrupt compressed data, size mismatch, a checksum that differs
            from the metadata's :attr:`~storage.base.SlotMeta.digest`, invalid SES1 header, or tokens that
            differ from the metadata.
        StoreUnavailableError: the store is unreachable.
    """
    got = await store.get(slot_id)
    if got is None:
        return None
    meta, data = got
    if meta.model_fingerprint != fingerprint:
        raise FingerprintMismatchError(slot_id, fingerprint, meta.model_fingerprint)
    raw = await asyncio.to_thread(_decode_checked, meta, data)
    return meta, raw
