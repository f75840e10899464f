"""Parse and check llama.cpp sequence state blobs before llama.cpp sees them.

``llama_state_seq_get_data`` (llama.cpp ``src/llama-context.cpp`` and
``src/llama-kv-cache.cpp`` of the pinned build) writes, little-endian::

    u32 io_magic (0xaf143cd8) | i32 source seq_id
    u32 n_stream
    per stream (an empty one is its cell_count 0 alone):
      u32 cell_count
      cell_count x (i32 pos | u32 n_seq_id (=1) | i32 seq_id)          # cells in ascending cell order
      u32 v_trans | u32 n_layer
      n_layer x (i32 k_type | u64 k_row_bytes | cell_count*k_row_bytes)
      if v_trans: n_layer x (i32 v_type | u32 v_elem_bytes | u32 n_embd_v_gqa | n_embd_v_gqa*cell_count*v_elem_bytes)
      else:       n_layer x (i32 v_type | u64 v_row_bytes | cell_count*v_row_bytes)

A blob from another model, another KV type or another build differs in these
fields; a truncated or padded blob differs in length.  :func:`parse` checks all of
them against the :class:`StateLayout` learned from this engine's own state, so a
refused blob never reaches ``llama_state_seq_set_data`` (whose failures can abort
the process).  :func:`check_finite` refuses K/V data holding NaN or infinity (a
damaged blob that llama.cpp would take and then decode into garbage).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

IO_MAGIC = 0xAF143CD8
MAX_STREAMS = 256  # LLAMA_MAX_SEQ (src/llama-cparams.h): a context has at most one stream per sequence

# ggml_type ids (ggml/include/ggml.h) of the float K/V types -> (word size in bytes, exponent mask).
# A value is NaN or infinite exactly when all its exponent bits are set.
FLOAT_WORDS = {0: (4, 0x7F800000), 1: (2, 0x7C00), 30: (2, 0x7F80)}  # F32, F16, BF16


class BadStateError(ValueError):
    """The blob is not a sequence state this engine can restore."""


@dataclass(frozen=True)
class LayerLayout:
    """Per-layer K/V record headers: ``(k_type, k_row_bytes)`` and V's type/sizes."""

    k_type: int
    k_row_bytes: int
    v_type: int
    v_elem_or_row_bytes: int
    n_embd_v_gqa: int


@dataclass(frozen=True)
class StateLayout:
    """What this engine's sequence states look like (learned at start-up): whether V is transposed
    (flash attention off) and each layer's K/V record headers."""

    v_trans: int
    layers: tuple[LayerLayout, ...]

    def bytes_per_cell(self) -> int:
        """KV bytes per cell (token) across all layers."""
        if self.v_trans:
            return sum(ly.k_row_bytes + ly.v_elem_or_row_bytes * ly.n_embd_v_gqa for ly in self.layers)
        return sum(ly.k_row_bytes + ly.v_elem_or_row_bytes for ly in self.layers)


@dataclass(frozen=True)
class ParsedState:
    """Result of :func:`parse`: positions in the blob's cell order; ``record`` is the byte range
    ``[start, end)`` of the stream record holding the cells (from its ``cell_count``), ``(0, 0)``
    for an empty state; ``n_stream`` the blob's stream count."""

    positions: np.ndarray  # int32[cell_count]
    layout: StateLayout
    data: tuple[tuple[int, int, int], ...] = ()  # (ggml_type, byte offset, byte length) of each K/V record
    record: tuple[int, int] = (0, 0)
    n_stream: int = 1


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.off = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.data):
            raise BadStateError(f"state truncated at byte {self.off} (needs {size} more)")
        vals = struct.unpack_from(fmt, self.data, self.off)
        self.off += size
        return vals

    def skip(self, n: int) -> None:
        if n < 0 or self.off + n > len(self.data):
            raise BadStateError(f"state truncated at byte {self.off} (needs {n} more)")
        self.off += n


def _read_stream(
    r: _Reader, cell_count: int
) -> tuple[np.ndarray, int, tuple[LayerLayout, ...], tuple[tuple[int, int, int], ...]]:
    """One stream's record after its ``cell_count``: ``(positions, v_trans, layers, data)``,
    ``data`` as :attr:`ParsedState.data`."""
    positions = _positions(r, cell_count)
    v_trans, n_layer = r.take("<II")
    if n_layer == 0 or n_layer > 4096:
        raise BadStateError(f"implausible layer count {n_layer}")
    k_heads: list[tuple[int, int]] = []
    data: list[tuple[int, int, int]] = []
    for _ in range(n_layer):
        k_type, k_row = r.take("<iQ")
        data.append((k_type, r.off, cell_count * k_row))
        r.skip(cell_count * k_row)
        k_heads.append((k_type, k_row))
    layers = []
    for k_type, k_row in k_heads:
        if v_trans:
            v_type, v_el, n_embd_v = r.take("<iII")
            size = v_el * n_embd_v * cell_count
        else:
            v_type, v_el = r.take("<iQ")
            n_embd_v = 0
            size = cell_count * v_el
        data.append((v_type, r.off, size))
        r.skip(size)
        layers.append(LayerLayout(k_type, k_row, v_type, v_el, n_embd_v))
    return positions, v_trans, tuple(layers), tuple(data)


def _positions(r: _Reader, cell_count: int) -> np.ndarray:
    """The ``int32[cell_count]`` positions of a stream's cell records at ``r`` (skipped)."""
    if cell_count == 0 or cell_count > (len(r.data) - r.off) // 12:
        raise BadStateError(f"implausible cell count {cell_count}")
    cells = np.frombuffer(r.data, dtype="<i4", count=3 * cell_count, offset=r.off).reshape(cell_count, 3)
    r.skip(12 * cell_count)
    if not np.all(cells[:, 1] == 1):
        raise BadStateError("state cells must each belong to exactly one sequence")
    return cells[:, 0].astype(np.int32)


def parse(
    blob: bytes | bytearray | memoryview, expect: StateLayout | None = None, io_header: bool = True
) -> ParsedState:
    """Parse a sequence state; check it against ``expect`` when given.

    ``io_header=False``: ``blob`` lacks the first 8 bytes (io magic, source sequence), as a
    ``ggsq`` file holds the state (:mod:`engine.ggsq`); the offsets in the result are then
    relative to where ``blob`` starts.  Any number of streams is accepted as long as at most one
    holds cells.  Only the header fields and cell records are read, so a memory map of a file is
    parsed without reading its K/V data.  Raises :class:`BadStateError` on a wrong magic,
    truncation, trailing bytes, cells in several streams or belonging to several sequences, or any
    layout field that differs from ``expect``.  An empty sequence (no cells) parses to zero positions.
    """
    r = _Reader(memoryview(blob).cast("B"))
    if io_header:
        magic, _src_seq = r.take("<Ii")
        if magic != IO_MAGIC:
            raise BadStateError(f"not a llama.cpp sequence state (magic {magic:#x})")
    (n_stream,) = r.take("<I")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise BadStateError(f"implausible KV stream count {n_stream}")
    found: ParsedState | None = None
    for _ in range(n_stream):
        if r.off == len(r.data) and found is None:
            break  # a state of no cells may end after its stream count
        start = r.off
        (cell_count,) = r.take("<I")
        if cell_count == 0:
            continue
        if found is not None:
            raise BadStateError("the state's cells are spread over several KV streams")
        positions, v_trans, layers, data = _read_stream(r, cell_count)
        found = ParsedState(positions, StateLayout(v_trans, layers), data, (start, r.off), n_stream)
    if r.off != len(r.data):
        raise BadStateError(f"{len(r.data) - r.off} unexpected bytes after the state")
    if found is None:
        return ParsedState(np.empty(0, dtype=np.int32), expect or StateLayout(0, ()), n_stream=n_stream)
    if expect is not None and found.layout != expect:
        raise BadStateError("state was written by another model, KV type, attention mode or llama.cpp build")
    return found


def parse_file(f: BinaryIO, start: int, expect: StateLayout | None = None) -> ParsedState:
    """:func:`parse` (``io_header=False``) of the state from byte ``start`` of the open file ``f`` to
    its end, on a memory map of the file: only the header fields and cell records are read,
    not the K/V data.  Raises :class:`BadStateError` as :func:`parse` does."""
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    refused = None
    try:
        parsed = parse(memoryview(mm)[start:], expect, io_header=False)
        parsed = ParsedState(parsed.positions.copy(), parsed.layout, parsed.data)
    except BadStateError as exc:
        refused = str(exc)  # not raised from here: its traceback would keep views of the map open
    mm.close()
    if refused is not None:
        raise BadStateError(refused)
    return parsed


def one_stream(blob: bytearray | memoryview) -> memoryview:
    """The one-stream form (``n_stream`` 1 and the record holding the cells) of a state as
    ``llama_state_seq_get_data`` wrote it into the writable ``blob``, in place: the 12 header bytes
    are written just before the record and the result is a view of ``blob`` (no copy).

    A state of no cells becomes ``magic | seq | 1 | 0``.  Raises :class:`BadStateError` when the
    blob is malformed or its cells are spread over several streams.
    """
    view = memoryview(blob).cast("B")
    parsed = parse(view)
    magic, seq = struct.unpack_from("<Ii", view, 0)
    start, end = parsed.record
    if end == start:
        struct.pack_into("<IiII", view, 0, magic, seq, 1, 0)
        return view[:16]
    struct.pack_into("<IiI", view, start - 12, magic, seq, 1)
    return view[start - 12 : end]


def single_stream(blob: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """``blob`` itself once :func:`parse` accepts it (a state of several streams whose cells are in one:
    every reader of states takes that form now).  Raises :class:`BadStateError` as :func:`parse`."""
    parse(blob)
    return blob


def has_nonfinite(values: np.ndarray, ggml_type: int) -> bool:
    """Whether ``values`` (K/V values of ``ggml_type``, little-endian, viewed as bytes or words,
    any shape whose last axis is contiguous) holds a NaN or an infinity; ``False`` for types
    other than F32/F16/BF16 (quantized blocks are not tested).

    A value is non-finite exactly when its exponent bits are all set: as a signed word it
    is then at least the exponent mask (positive) and as an unsigned word at least sign bit
    + mask (negative).  Two reductions over the words, no temporary array, no float conversion.
    """
    word = FLOAT_WORDS.get(ggml_type)
    if word is None or not values.size:
        return False
    size, mask = word
    unsigned = values.view(f"<u{size}")
    if int(unsigned.view(f"<i{size}").max()) >= mask:
        return True
    return int(unsigned.max()) >= (1 << (8 * size - 1)) | mask


def check_finite(blob: bytes | bytearray | memoryview, parsed: ParsedState) -> None:
    """Refuse a state whose float K/V values include NaN or +-infinity.

    ``parsed`` is :func:`parse`'s result for ``blob``.  Every F32, F16 and BF16 record
    (ggml types 0, 1, 30) is viewed in place as little-endian words and its exponent
    bits are tested in place by :func:`has_nonfinite` (no float conversion); records
    of quantized types (their block scales included) are not checked.  Cost: see
    ``benchmarks/bench_integrity.py`` (docs/benchmarks.md has the figures).

    Raises:
        BadStateError: naming the first record (``K``/``V`` of a layer) that holds a
            non-finite value.
    """
    view = memoryview(blob).cast("B")
    n_layer = len(parsed.data) // 2
    for i, (ggml_type, off, size) in enumerate(parsed.data):
        word = FLOAT_WORDS.get(ggml_type)
        if word is None or size == 0:
            continue
        values = np.frombuffer(view, dtype=np.uint8, count=size - size % word[0], offset=off)
        if has_nonfinite(values, ggml_type):
            raise BadStateError(nonfinite_message("K" if i < n_layer else "V", i % n_layer))


def nonfinite_message(what: str, layer: int) -> str:
    """The refusal of a state whose ``what`` (``"K"``/``"V"``) cache of ``layer`` holds NaN or infinity."""
    return f"the state's {what} cache of layer {layer} holds NaN or infinite values"
