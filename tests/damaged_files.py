"""Damaged llama.cpp sequence-state files (``ggsq``, :mod:`slotstate.ggsq`) for the tests of the engine and the
server (llama-free: only the byte formats)."""

from __future__ import annotations

import struct

from slotstate import seq_state


def poisoned(data: bytes, record: int) -> bytes:
    """A ggsq file whose K/V record ``record`` (0..2*n_layer-1: the layers' K, then their V; -1 the last) holds an
    f16 NaN in the middle of its values."""
    n_words = struct.unpack_from("<I", data, 8)[0]
    start = 12 + 4 * n_words - 8  # the state's KV part, with 8 bytes in front as a state has them
    blob = bytearray(data[start:])
    blob[:8] = struct.pack("<Ii", seq_state.IO_MAGIC, 0)
    ggml_type, off, size = seq_state.parse(blob).data[record]
    assert ggml_type == 1, "an F16 cache"
    out = bytearray(data)
    struct.pack_into("<H", out, start + off + size // 2 // 2 * 2, 0x7E00)
    return bytes(out)
