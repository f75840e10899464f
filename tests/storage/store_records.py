"""Slot records shared by the store contract tests (``test_storage_contract.py``, ``test_storage_integrity.py``,
``test_storage_leases.py``): a :class:`storage.base.SlotMeta` for a raw blob, and blobs whose content says
which write they came from."""

from __future__ import annotations

import struct

from storage.base import SlotMeta


def meta_for(slot_id: str, blob: bytes, k: int = 0, fingerprint: str = "fp-A") -> SlotMeta:
    """Meta for a raw test blob; ``k`` (stored as the only token) identifies the blob's content."""
    return SlotMeta(
        slot_id=slot_id,
        model_fingerprint=fingerprint,
        n_tokens=1,
        tokens=[k],
        codec="none",
        level=0,
        raw_size=len(blob),
        stored_size=len(blob),
        created_at=0.0,
        updated_at=0.0,
    )


def blob_for(k: int) -> bytes:
    """Content that encodes ``k`` everywhere, with a size that varies with ``k`` (3000..7900 bytes)."""
    size = 3000 + (k * 700) % 5000
    return (struct.pack("<Q", k) * (size // 8 + 1))[:size]
