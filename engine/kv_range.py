"""Reading the KV of position ranges of one sequence (``llama_attn_seq_range_get``, ``libllama/llama-attn.h``).

A range's record is llama.cpp's own stream record of those cells (:mod:`slotstate.kv_chunks` has the
layout), read from the KV cache with ``ggml_backend_tensor_get`` per run of consecutive cells: a turn
that stores only the chunks its new tokens touched reads only those (not ``llama_state_seq_get_data``'s
whole sequence).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from contract.errors import ErrorCode
from engine import native
from engine.errors import EngineError

__all__ = ["read_range", "read_ranges"]


def read_range(ctx: object, cache: int, seq: int, p0: int, p1: int) -> bytearray:
    """The record of positions ``[p0, p1)`` of sequence ``seq`` in KV cache ``cache`` (0: the global or
    only one, 1: a sliding-window model's sliding layers) as ``bytearray``; ``u32 0`` alone when the
    cache holds none of them.  Raises ``EngineError(INVALID_REQUEST)`` for a cache, sequence or range
    libllama refuses, ``EngineError(INTERNAL)`` when the read fails."""
    if not 0 <= p0 <= p1 < 2**31:
        raise EngineError(ErrorCode.INVALID_REQUEST, f"bad position range [{p0}, {p1})")
    size = native.lib.llama_attn_seq_range_get(ctx, cache, seq, p0, p1, None, 0)
    if size < 0:
        raise EngineError(ErrorCode.INVALID_REQUEST, f"no KV cache {cache} or sequence {seq} to read")
    out = bytearray(size)
    got = native.lib.llama_attn_seq_range_get(ctx, cache, seq, p0, p1, (ctypes.c_uint8 * size).from_buffer(out), size)
    if got != size:
        raise EngineError(ErrorCode.INTERNAL, f"llama_attn_seq_range_get wrote {got} of {size} bytes")
    return out


def read_ranges(ctx: object, seq: int, ranges: Sequence[tuple[int, int, int]]) -> list[bytearray]:
    """:func:`read_range` of each ``(cache, p0, p1)`` of ``ranges``, in order."""
    return [read_range(ctx, cache, seq, p0, p1) for cache, p0, p1 in ranges]
