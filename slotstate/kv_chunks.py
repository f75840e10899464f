"""KV chunks: a sequence's KV cache record cut by position ranges, and joined back into a state.

llama.cpp writes a sequence's KV cache as one *stream record* (``state_write_meta``/``state_write_data``
of ``src/llama-kv-cache.cpp``; :mod:`slotstate.seq_state` describes it)::

    u32 cell_count | cell_count x (i32 pos | u32 1 | i32 seq_id)
    | u32 v_trans | u32 n_layer | n_layer x (i32 k_type | u64 k_row_bytes | cell_count K rows)
    | n_layer x (i32 v_type | u64 v_row_bytes | cell_count V rows)                           (v_trans 0)
      or n_layer x (i32 v_type | u32 v_elem_bytes | u32 n_embd_v_gqa | n_embd_v_gqa x cell_count elements)  (v_trans 1)

The patched libllama's ``llama_attn_seq_range_get`` (``libllama/llama-attn.h``) writes the record of the
cells of one position range ``[p0, p1)`` in that same layout, in position order.  A *chunk* is such a
record for :data:`CHUNK_TOKENS` positions.  :func:`join_records` concatenates the records of consecutive
ranges into the record of their union (per layer: K rows one after another; V rows, or with ``v_trans``
each embedding row's elements), which is what ``llama_state_seq_get_data`` writes for a sequence whose
cells ascend with their positions; :func:`state_of` wraps the records of the model's KV caches in the
one-stream state form the engine restores (``u32 io_magic | i32 seq | per cache: u32 1 | record``).

:func:`seal` and :func:`unseal` frame a chunk for a store with its own checksum (XXH3-128 of its key and
bytes), so that a chunk lost, damaged or stored under another chunk's key is refused
(:class:`BadStateError`) and never restored.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from slotstate.errors import BadStateError
from slotstate.seq_state import IO_MAGIC, CacheLayout, _MemoryReader, _read_stream

__all__ = [
    "CHUNK_TOKENS",
    "RangeRecord",
    "chunk_bounds",
    "chunk_keys",
    "join_records",
    "parse_record",
    "plan_ranges",
    "seal",
    "state_of",
    "unseal",
]

CHUNK_TOKENS = 256
"""Positions per chunk (a chunk of SmolLM2-135M's f16 KV is about 5.9 MB)."""

_SEAL = struct.Struct("<4sQ16s")  # magic, payload bytes, XXH3-128 digest of the payload
_SEAL_MAGIC = b"KVC1"


@dataclass(frozen=True)
class RangeRecord:
    """A parsed stream record (:func:`parse_record`): ``n_cells`` cells at ``positions`` (``int32[n]``),
    its ``layout``, and each K then V record's ``(ggml_type, byte offset, byte length)`` in ``data``."""

    view: memoryview
    n_cells: int
    positions: np.ndarray
    layout: CacheLayout | None
    data: tuple[tuple[int, int, int], ...]


def chunk_bounds(n_tokens: int, size: int = CHUNK_TOKENS) -> list[tuple[int, int]]:
    """The position ranges ``[p0, p1)`` of the chunks of ``n_tokens`` positions: full chunks of ``size``
    and a last partial one (none for 0 tokens)."""
    if size <= 0:
        raise ValueError(f"chunk size must be positive, not {size}")
    return [(p0, min(p0 + size, n_tokens)) for p0 in range(0, n_tokens, size)]


def plan_ranges(
    n_tokens: int, stored: Sequence[tuple[int, int]], n_same: int, size: int = CHUNK_TOKENS, cut: int = 0
) -> list[tuple[int, int]]:
    """The ranges of the chunks that store ``n_tokens`` positions, given the ranges ``stored`` of the
    slot's stored state and ``n_same``, how many of its first tokens are unchanged since (their common
    prefix: a truncation, context shift or cache reuse changes the tokens from there on).

    The stored ranges that end within the unchanged prefix are kept; the positions after them are cut at
    the multiples of ``size`` (a turn adds one range per chunk its new tokens touch).  A range that
    completes a chunk (ends at a multiple of ``size``) replaces the ranges it completes by the whole
    chunk, so a conversation's ranges are whole chunks but the last (shared by every conversation with
    the same tokens: :func:`chunk_keys`) and each position is written at most twice.

    ``cut`` (0: none), a position where conversations commonly part (the end of the first chat message,
    the system prompt), is a boundary no range crosses: the chunk holding it is stored as the range
    up to ``cut`` and the range after it, so conversations that share a system prompt of a length that is
    no multiple of ``size`` share its last, partial chunk too."""
    kept: list[tuple[int, int]] = []
    for p0, p1 in stored:
        if p0 != (kept[-1][1] if kept else 0) or p1 > min(n_same, n_tokens):
            break
        kept.append((p0, p1))
    start = kept[-1][1] if kept else 0
    starts = {start, *range(start - start % size + size, n_tokens, size)} if start < n_tokens else set()
    if start < cut < n_tokens:
        starts.add(cut)
    for p0 in sorted(starts):
        p1 = min(p0 - p0 % size + size, n_tokens)
        if p0 < cut < p1:
            p1 = cut
        if p1 % size == 0 and p0 % size:
            lo = p1 - size
            if lo < cut < p1:
                lo = cut
            while kept and kept[-1][0] >= lo:
                kept.pop()
            if kept and kept[-1][1] > lo:  # a range stored before the cut was known: merged whole
                lo = kept.pop()[0]
            p0 = lo
        kept.append((p0, p1))
    return kept


def chunk_keys(scope: bytes, tokens: Sequence[int] | np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[str]:
    """The key of each of ``ranges`` (contiguous from position 0, as :func:`plan_ranges` gives them): 32 hex
    digits of XXH3-128 over ``scope`` (the model, tenant and cache partition: chunks are shared only within
    it), the tokens of positions ``[0, p1)`` as int32 and ``p0, p1``.  Equal keys mean equal token prefixes
    and bounds (LMCache's chunk-by-prefix-hash, scoped)."""
    ids = np.asarray(tokens, dtype="<i4")
    h = xxhash.xxh3_128(scope)
    done = 0
    out = []
    for p0, p1 in ranges:
        if p0 > done:
            raise ValueError(f"ranges must be contiguous from 0: [{p0}, {p1}) after {done}")
        if p1 > done:
            h.update(ids[done:p1].tobytes())
            done = p1
        k = h.copy()
        k.update(struct.pack("<ii", p0, p1))
        out.append(k.hexdigest())
    return out


def parse_record(record: bytes | bytearray | memoryview) -> RangeRecord:
    """Parse one stream record (the module docstring's layout) that fills ``record`` exactly.

    Raises :class:`BadStateError` on truncation, trailing bytes, or cells not of exactly one sequence."""
    view = memoryview(record).cast("B")
    r = _MemoryReader(view)
    (n,) = r.take("<I")
    if n == 0:
        if r.off != len(view):
            raise BadStateError(f"{len(view) - r.off} unexpected bytes after an empty KV record")
        return RangeRecord(view, 0, np.empty(0, dtype=np.int32), None, ())
    positions, layout, data = _read_stream(r, n)
    if r.off != len(view):
        raise BadStateError(f"{len(view) - r.off} unexpected bytes after a KV record")
    return RangeRecord(view, n, positions, layout, data)


def join_records(
    records: Sequence[bytes | bytearray | memoryview],
    before: bytes | bytearray | memoryview = b"",
    after: bytes | bytearray | memoryview = b"",
) -> bytearray:
    """The stream record of the union of consecutive ranges' records (``records`` in position order):
    ``u32 n`` (their cells' sum), the cells' metadata in order, and per layer the K rows and V rows (or,
    transposed, each embedding row's elements) of every record in order.  Records of no cells are
    skipped; none with cells gives the empty record ``u32 0``.  ``before`` and ``after``: bytes written
    before and after the record in the same buffer (a state's headers and its other parts), so a caller
    that frames the record copies no state-sized buffer again.

    Raises :class:`BadStateError` when a record is malformed, the records' layouts differ (another
    model, KV type or attention mode), or their positions do not ascend.
    """
    parts = [p for p in (parse_record(r) for r in records) if p.n_cells]
    if not parts:
        return bytearray(b"".join((before, struct.pack("<I", 0), after)))
    layout = parts[0].layout
    assert layout is not None
    if any(p.layout != layout for p in parts[1:]):
        raise BadStateError("the KV chunks were written by different models, KV types or attention modes")
    positions = np.concatenate([p.positions for p in parts])
    if len(positions) > 1 and not np.all(np.diff(positions) > 0):
        raise BadStateError("the KV chunks' positions do not ascend")
    n = len(positions)
    n_layer = len(layout.layers)
    meta = 12 * n
    size = 4 + meta + 8 + sum(len(p.view) - 4 - 12 * p.n_cells - 8 for p in parts)
    size -= (len(parts) - 1) * n_layer * 24  # each layer's two 12-byte headers once, not per record
    base = len(before)
    out = bytearray(base + size + len(after))
    out[:base] = before
    out[base + size :] = after
    dst = np.frombuffer(out, dtype=np.uint8)
    struct.pack_into("<I", out, base, n)
    off = base + 4
    for p in parts:
        dst[off : off + 12 * p.n_cells] = np.frombuffer(p.view, dtype=np.uint8, count=12 * p.n_cells, offset=4)
        off += 12 * p.n_cells
    struct.pack_into("<II", out, off, layout.v_trans, n_layer)
    off += 8
    for i in range(2 * n_layer):
        head_end = parts[0].data[i][1]
        head = 12  # i32 type | u64 row bytes, or with v_trans: i32 type | u32 elem bytes | u32 n_embd_v
        dst[off : off + head] = np.frombuffer(parts[0].view, dtype=np.uint8, count=head, offset=head_end - head)
        off += head
        total = sum(p.data[i][2] for p in parts)
        if i >= n_layer and layout.v_trans:
            lay = layout.layers[i - n_layer]
            el, rows = lay.v_elem_or_row_bytes, lay.n_embd_v_gqa
            target = dst[off : off + total].reshape(rows, n * el)
            col = 0
            for p in parts:
                _, o, length = p.data[i]
                width = p.n_cells * el
                target[:, col : col + width] = np.frombuffer(p.view, dtype=np.uint8, count=length, offset=o).reshape(
                    rows, width
                )
                col += width
        else:
            at = off
            for p in parts:
                _, o, length = p.data[i]
                dst[at : at + length] = np.frombuffer(p.view, dtype=np.uint8, count=length, offset=o)
                at += length
        off += total
    if off != base + size:
        raise BadStateError(f"joined KV record is {off - base} bytes, expected {size}")
    return out


def state_of(records: Sequence[bytes | bytearray | memoryview], seq: int = 0) -> bytearray:
    """The one-stream sequence state (:func:`slotstate.seq_state.one_stream`'s form) of one stream record
    per KV cache part, in llama.cpp's order: ``u32 io_magic | i32 seq | per part: u32 1 | record``."""
    out = bytearray(struct.pack("<Ii", IO_MAGIC, seq))
    for record in records:
        out += struct.pack("<I", 1)
        out += record
    return out


def _digest(key: str, body: memoryview) -> bytes:
    h = xxhash.xxh3_128(key.encode("ascii"))
    h.update(body)
    return h.digest()


def seal(record: bytes | bytearray | memoryview, key: str) -> bytes:
    """``record`` framed for a store under ``key``: ``b"KVC1" | u64 length | XXH3-128 digest of key and
    record (16 bytes) | record``."""
    view = memoryview(record).cast("B")
    return _SEAL.pack(_SEAL_MAGIC, len(view), _digest(key, view)) + view


def unseal(data: bytes | bytearray | memoryview, key: str) -> memoryview:
    """The record inside a :func:`seal` frame stored under ``key`` (a view), after checking its magic,
    length and digest.

    Raises :class:`BadStateError` for any difference (a damaged or truncated chunk, or another key's)."""
    view = memoryview(data).cast("B")
    if len(view) < _SEAL.size:
        raise BadStateError(f"KV chunk of {len(view)} bytes is truncated")
    magic, length, digest = _SEAL.unpack_from(view, 0)
    body = view[_SEAL.size :]
    if magic != _SEAL_MAGIC or length != len(body):
        raise BadStateError("KV chunk is damaged (wrong frame or length)")
    if _digest(key, body) != digest:
        raise BadStateError("KV chunk is damaged (its checksum differs)")
    return body
