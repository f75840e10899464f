"""Parse and check llama.cpp sequence state blobs before llama.cpp sees them.

``llama_state_seq_get_data`` (llama.cpp ``src/llama-context.cpp``) writes ``u32 io_magic
(0xaf143cd8) | i32 source seq_id`` and then the memory's own record of the sequence, which is one
*part* per piece of the model's memory, in llama.cpp's order (``state_write`` of
``src/llama-kv-cache-iswa.cpp``, ``src/llama-memory-hybrid.cpp``, ``src/llama-memory-hybrid-iswa.cpp``):

* a transformer: one KV cache part;
* a sliding-window model (``llama_kv_cache_iswa``): the global layers' KV cache, then the sliding
  layers' (its cells hold only the recent positions);
* a hybrid model: its KV cache part(s), then the recurrent part;
* a recurrent model: the recurrent part alone.

A KV cache part (``src/llama-kv-cache.cpp``), little-endian::

    u32 n_stream
    per stream (an empty one is its cell_count 0 alone):
      u32 cell_count
      cell_count x (i32 pos | u32 n_seq_id (=1) | i32 seq_id)          # cells in ascending cell order
      u32 v_trans | u32 n_layer
      n_layer x (i32 k_type | u64 k_row_bytes | cell_count*k_row_bytes)
      if v_trans: n_layer x (i32 v_type | u32 v_elem_bytes | u32 n_embd_v_gqa | n_embd_v_gqa*cell_count*v_elem_bytes)
      else:       n_layer x (i32 v_type | u64 v_row_bytes | cell_count*v_row_bytes)

The recurrent part (``src/llama-memory-recurrent.cpp``: ``u32 cell_count | cell_count x (i32 pos |
u32 0) | ...`` then the per-layer R/S state rows) is kept as an opaque tail: its cell header is read
(a sequence has one cell, at its last position) and its length checked against this engine's own
(:attr:`StateLayout.recurrent_bytes`); llama.cpp's ``llama_state_seq_set_data`` reads the rest.
Which parts a state has is decided per model at start-up from llama.cpp's own facts
(:class:`StateShape`), never from the bytes.

A blob from another model, another KV type or another build differs in these fields; a truncated
or padded blob differs in length.  :func:`parse` checks all of them against the
:class:`StateLayout` learned from this engine's own state, so a refused blob never reaches
``llama_state_seq_set_data`` (whose failures can abort the process).  :func:`check_finite`
refuses K/V data holding NaN or infinity (a damaged blob that llama.cpp would take and then
decode into garbage).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from slotstate.errors import BadStateError

IO_MAGIC = 0xAF143CD8
MAX_STREAMS = 256  # LLAMA_MAX_SEQ (src/llama-cparams.h): a context has at most one stream per sequence

# ggml_type ids (ggml/include/ggml.h) of the float K/V types -> (word size in bytes, exponent mask).
# A value is NaN or infinite exactly when all its exponent bits are set.
FLOAT_WORDS = {0: (4, 0x7F800000), 1: (2, 0x7C00), 30: (2, 0x7F80)}  # F32, F16, BF16


@dataclass(frozen=True)
class StateShape:
    """The parts of a model's sequence state (see the module docstring): ``n_caches`` KV cache parts
    (0: none, 1, or 2 for a sliding-window model) followed, when ``recurrent``, by a recurrent part."""

    n_caches: int = 1
    recurrent: bool = False


@dataclass(frozen=True)
class LayerLayout:
    """Per-layer K/V record headers: ``(k_type, k_row_bytes)`` and V's type/sizes."""

    k_type: int
    k_row_bytes: int
    v_type: int
    v_elem_or_row_bytes: int
    n_embd_v_gqa: int


@dataclass(frozen=True)
class CacheLayout:
    """One KV cache part's record layout: whether V is transposed (flash attention off) and each
    layer's K/V record headers."""

    v_trans: int
    layers: tuple[LayerLayout, ...]


@dataclass(frozen=True)
class StateLayout:
    """What this engine's sequence states look like (learned at start-up from its own state): each KV
    cache part's layout, in llama.cpp's order, and the byte length of the recurrent part of a
    sequence's state (-1: the memory has no recurrent part)."""

    caches: tuple[CacheLayout, ...]
    recurrent_bytes: int = -1

    @property
    def shape(self) -> StateShape:
        """The parts this layout describes."""
        return StateShape(len(self.caches), self.recurrent_bytes >= 0)

    @property
    def v_trans(self) -> int:
        """Whether V is stored transposed (flash attention off) in the KV caches (0 without one)."""
        return self.caches[0].v_trans if self.caches else 0


@dataclass(frozen=True)
class ParsedState:
    """Result of :func:`parse`.

    ``positions``: the positions of the first KV cache part's cells in the blob's cell order (a
    recurrent model: its cell's); ``records``: per KV cache part, the byte range ``[start, end)`` of
    the stream record holding the cells (from its ``cell_count``), ``(0, 0)`` for an empty state;
    ``tail``: the byte range of the recurrent part (empty without one); ``cache_positions``: every
    KV cache part's positions; ``n_stream`` the blob's stream count (of its first part).
    """

    positions: np.ndarray  # int32[cell_count]
    layout: StateLayout
    data: tuple[tuple[int, int, int], ...] = ()  # (ggml_type, byte offset, byte length) of each K/V record
    records: tuple[tuple[int, int], ...] = ()
    n_stream: int = 1
    tail: tuple[int, int] = (0, 0)
    cache_positions: tuple[np.ndarray, ...] = ()

    @property
    def record(self) -> tuple[int, int]:
        """The first KV cache part's record (``(0, 0)`` when none)."""
        return self.records[0] if self.records else (0, 0)

    @property
    def empty(self) -> bool:
        """The state holds no cells."""
        return len(self.positions) == 0


class _Reader:
    """A state's bytes read from ``off`` on; ``size``: how many there are.  :class:`_MemoryReader` and
    :class:`_FileReader` say where they are."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.off = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))

    def read(self, n: int) -> bytes | memoryview:
        """The next ``n`` bytes."""
        self._check(n)
        got = self._at(self.off, n)
        self.off += n
        return got

    def skip(self, n: int) -> None:
        self._check(n)
        self.off += n

    def _check(self, n: int) -> None:
        if n < 0 or self.off + n > self.size:
            raise BadStateError(f"state truncated at byte {self.off} (needs {n} more)")

    def _at(self, off: int, n: int) -> bytes | memoryview:
        raise NotImplementedError


class _MemoryReader(_Reader):
    """The state's bytes in memory (views of them, nothing copied)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__(len(data))
        self.data = data

    def _at(self, off: int, n: int) -> bytes | memoryview:
        return self.data[off : off + n]


class _FileReader(_Reader):
    """The state's bytes in an open file from byte ``start`` to its end, each read with ``pread``: a file
    written over in place meanwhile gives a short read (refused), where a memory map of it would raise SIGBUS
    and end the process (mmap(2))."""

    def __init__(self, fd: int, start: int) -> None:
        super().__init__(max(0, os.fstat(fd).st_size - start))
        self.fd, self.start = fd, start

    def _at(self, off: int, n: int) -> bytes | memoryview:
        got = os.pread(self.fd, n, self.start + off)
        if len(got) < n:
            raise BadStateError(f"state truncated at byte {off + len(got)}: the file ended while it was read")
        return got


def _read_stream(r: _Reader, cell_count: int) -> tuple[np.ndarray, CacheLayout, tuple[tuple[int, int, int], ...]]:
    """One stream's record after its ``cell_count``: ``(positions, layout, data)``, ``data`` as
    :attr:`ParsedState.data`."""
    positions = _positions(r, cell_count, 1)
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
    return positions, CacheLayout(v_trans, tuple(layers)), tuple(data)


def _positions(r: _Reader, cell_count: int, n_seq_id: int) -> np.ndarray:
    """The ``int32[cell_count]`` positions of ``cell_count`` cell records ``(pos, n_seq_id[, seq_id])``
    at ``r`` (skipped): a KV cache's name their one sequence (``n_seq_id`` 1), a recurrent memory's
    none (0)."""
    width = 2 + n_seq_id
    if cell_count == 0 or cell_count > (r.size - r.off) // (4 * width):
        raise BadStateError(f"implausible cell count {cell_count}")
    cells = np.frombuffer(r.read(4 * width * cell_count), dtype="<i4").reshape(cell_count, width)
    if not np.all(cells[:, 1] == n_seq_id):
        raise BadStateError("state cells must each belong to exactly one sequence")
    return cells[:, 0].astype(np.int32)


@dataclass
class _Part:
    """One KV cache part as :func:`_read_part` found it."""

    n_stream: int
    record: tuple[int, int] = (0, 0)
    positions: np.ndarray | None = None
    layout: CacheLayout | None = None
    data: tuple[tuple[int, int, int], ...] = ()


def _read_part(r: _Reader, last: bool) -> _Part:
    """A KV cache part at ``r``: any number of streams, at most one holding cells.  ``last``: the
    state's last part (a state of no cells may end right after its stream count)."""
    (n_stream,) = r.take("<I")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise BadStateError(f"implausible KV stream count {n_stream}")
    part = _Part(n_stream)
    for _ in range(n_stream):
        if last and r.off == r.size and part.positions is None:
            break
        start = r.off
        (cell_count,) = r.take("<I")
        if cell_count == 0:
            continue
        if part.positions is not None:
            raise BadStateError("the state's cells are spread over several KV streams")
        part.positions, part.layout, part.data = _read_stream(r, cell_count)
        part.record = (start, r.off)
    return part


def _read_tail(r: _Reader) -> tuple[tuple[int, int], np.ndarray]:
    """The recurrent part at ``r`` (the rest of the blob): its byte range and its cells' positions."""
    start = r.off
    (cell_count,) = r.take("<I")
    positions = _positions(r, cell_count, 0) if cell_count else np.empty(0, dtype=np.int32)
    r.off = r.size
    return (start, r.off), positions


def parse(
    blob: bytes | bytearray | memoryview,
    expect: StateLayout | None = None,
    io_header: bool = True,
    shape: StateShape | None = None,
) -> ParsedState:
    """Parse a sequence state of ``shape``'s parts (``expect``'s when given, else one KV cache part);
    check it against ``expect`` when given.

    ``io_header=False``: ``blob`` lacks the first 8 bytes (io magic, source sequence), as a
    ``ggsq`` file holds the state (:mod:`slotstate.ggsq`); the offsets in the result are then
    relative to where ``blob`` starts.  Any number of streams is accepted in each KV cache part as
    long as at most one holds cells.  Only the header fields and cell records are read (a file's with
    :func:`parse_file`, without reading its K/V data).  Raises :class:`BadStateError` on a wrong
    magic, truncation, trailing bytes, cells in several streams or belonging to several sequences,
    a recurrent part of another length than ``expect``'s, or any layout field that differs from
    ``expect``.  An empty sequence (no cells) parses to zero positions.
    """
    return _parse(_MemoryReader(memoryview(blob).cast("B")), expect, io_header, shape)


def _parse(r: _Reader, expect: StateLayout | None, io_header: bool, shape: StateShape | None) -> ParsedState:
    """:func:`parse` of the bytes ``r`` reads."""
    shape = expect.shape if expect is not None else shape or StateShape()
    if io_header:
        magic, _src_seq = r.take("<Ii")
        if magic != IO_MAGIC:
            raise BadStateError(f"not a llama.cpp sequence state (magic {magic:#x})")
    parts = [_read_part(r, last=i == shape.n_caches - 1 and not shape.recurrent) for i in range(shape.n_caches)]
    tail, tail_positions = ((r.off, r.off), np.empty(0, dtype=np.int32))
    if shape.recurrent:
        tail, tail_positions = _read_tail(r)
    if r.off != r.size:
        raise BadStateError(f"{r.size - r.off} unexpected bytes after the state")
    cache_positions = tuple(p.positions for p in parts if p.positions is not None)
    partial = parts and shape.recurrent and bool(cache_positions) != bool(len(tail_positions))
    if 0 < len(cache_positions) < len(parts) or partial:
        raise BadStateError("the state holds cells in some parts of the model's memory and none in others")
    layouts = tuple(p.layout for p in parts if p.layout is not None)
    empty = not cache_positions and not len(tail_positions)
    if empty:
        layout = expect or StateLayout((), -1)
    else:
        layout = StateLayout(layouts, tail[1] - tail[0] if shape.recurrent else -1)
        if expect is not None and (layout.caches != expect.caches or layout.recurrent_bytes != expect.recurrent_bytes):
            raise BadStateError("state was written by another model, KV type, attention mode or llama.cpp build")
    positions = cache_positions[0] if cache_positions else tail_positions
    return ParsedState(
        positions,
        layout,
        tuple(d for p in parts for d in p.data),
        tuple(p.record for p in parts) if cache_positions else (),
        parts[0].n_stream if parts else 1,
        tail,
        cache_positions,
    )


def parse_file(
    f: BinaryIO, start: int, expect: StateLayout | None = None, shape: StateShape | None = None
) -> ParsedState:
    """:func:`parse` (``io_header=False``) of the state from byte ``start`` of the open file ``f`` to
    its end: only the header fields and cell records are read (``pread``, tens of small reads), not the K/V
    data.  Raises :class:`BadStateError` as :func:`parse` does, and when the file ends while it is read (a file
    written over in place meanwhile: a short read, where a memory map would raise SIGBUS)."""
    return _parse(_FileReader(f.fileno(), start), expect, False, shape)


def one_stream(blob: bytearray | memoryview, shape: StateShape | None = None) -> memoryview:
    """The one-stream form of a state of ``shape``'s parts (default one KV cache part) as
    ``llama_state_seq_get_data`` wrote it into the writable ``blob``, in place: each KV cache part
    becomes ``n_stream`` 1 and the record holding the cells, followed by the recurrent part as it
    was.  The result is a view of ``blob``: the 12 header bytes are written just before the first
    record, and further parts are moved down behind it (nothing copied for a single KV cache).

    A state of no cells becomes ``magic | seq`` then ``1 | 0`` per KV cache part and the recurrent
    part's ``0``.  Raises :class:`BadStateError` when the blob is malformed or its cells are spread
    over several streams.
    """
    shape = shape or StateShape()
    view = memoryview(blob).cast("B")
    parsed = parse(view, shape=shape)
    magic, seq = struct.unpack_from("<Ii", view, 0)
    if parsed.empty:
        out = struct.pack("<Ii", magic, seq) + struct.pack("<II", 1, 0) * shape.n_caches + b"\0" * 4 * shape.recurrent
        view[: len(out)] = out
        return view[: len(out)]
    if not parsed.records:  # a recurrent model: its part follows the io header already
        return view
    data = np.frombuffer(view, dtype=np.uint8)
    head = parsed.records[0][0] - 12
    struct.pack_into("<IiI", view, head, magic, seq, 1)
    end = parsed.records[0][1]
    moves = [(*record, True) for record in parsed.records[1:]] + [(*parsed.tail, False)]
    for start, stop, kv_part in moves:  # moved down behind the first record
        if kv_part:
            struct.pack_into("<I", view, end, 1)  # its n_stream
            end += 4
        data[end : end + stop - start] = data[start:stop]  # numpy copies overlapping ranges as memmove does
        end += stop - start
    del data
    return view[head:end]


def single_stream(
    blob: bytes | bytearray | memoryview, shape: StateShape | None = None
) -> bytes | bytearray | memoryview:
    """``blob`` itself once :func:`parse` accepts it (a state of several streams whose cells are in one:
    every reader of states takes that form now).  Raises :class:`BadStateError` as :func:`parse`."""
    parse(blob, shape=shape)
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
    ``benchmarks/bench_integrity.py`` (docs/benchmarks.md has the figures).  A recurrent part
    is not checked (its values are llama.cpp's to read).

    Raises:
        BadStateError: naming the first record (``K``/``V`` of a layer) that holds a
            non-finite value.
    """
    if not parsed.data:
        return  # no cells, nothing to test
    view = memoryview(blob).cast("B")
    records = iter(parsed.data)  # per KV cache part: its layers' K records, then their V records
    for cache in parsed.layout.caches:
        n_layer = len(cache.layers)
        for i in range(2 * n_layer):
            ggml_type, off, size = next(records)
            word = FLOAT_WORDS.get(ggml_type)
            if word is None or size == 0:
                continue
            values = np.frombuffer(view, dtype=np.uint8, count=size - size % word[0], offset=off)
            if has_nonfinite(values, ggml_type):
                raise BadStateError(nonfinite_message("K" if i < n_layer else "V", i % n_layer))


def nonfinite_message(what: str, layer: int) -> str:
    """The refusal of a state whose ``what`` (``"K"``/``"V"``) cache of ``layer`` holds NaN or infinity."""
    return f"the state's {what} cache of layer {layer} holds NaN or infinite values"
