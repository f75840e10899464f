"""Sequence states read straight from the KV cache tensors, at memory speed.

``llama_state_seq_get_data`` (``src/llama-kv-cache.cpp``, ``state_write_data``) copies a
sequence's cells run by run: one ``ggml_backend_tensor_get`` per run of consecutive cells
for K, and with flash attention off (V transposed) one per run *per V row* and layer.  When
concurrent decoding interleaves sequences' cells every run is one cell long, and a
2000-token state becomes millions of tiny copies (seconds on a GPU).

:class:`KvReader` writes byte for byte the same state (the format is documented in
:mod:`engine.seq_state`) from the cell mirror (:mod:`engine.cellmap`), which knows the
cell of every position: per layer it reads the span of cells the sequence occupies with
one ``ggml_backend_tensor_get`` (K) and one ``ggml_backend_tensor_get_2d`` (all V rows),
or views host memory in place, and gathers the sequence's cells with numpy.  Its cost
depends on the bytes, not on how the cells interleave.

The cache tensors ``cache_k_l{il}`` / ``cache_v_l{il}`` are found from layer 0's K tensor,
which the attention capture meets in every decode (the ``SET_ROWS`` node writing it), by
walking the ``ggml_context`` that owns it: ``ggml_new_tensor`` allocates each tensor after
a ``struct ggml_object`` header whose ``next`` links the context's objects
(``ggml/src/ggml.c``, ``ggml_get_next_tensor``).  Each tensor found is checked (name,
op, shape, type, row size) against the state layout learned at start-up, and the engine
compares the first fast read with llama.cpp's own before it trusts the reader.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import llama_cpp as llama
import numpy as np

from engine import ggml_ffi as g
from engine.seq_state import IO_MAGIC, StateLayout

# struct ggml_object (ggml/src/ggml.c): size_t offs; size_t size; ggml_object *next; enum type; char pad[4]
_OBJ_SIZE = 32
_OBJ_NEXT = 16
_OBJ_TYPE = 24
_OBJ_TENSOR = 0  # GGML_OBJECT_TYPE_TENSOR
_MAX_OBJECTS = 1 << 16

_lib = g.libggml
_lib.ggml_backend_tensor_get_2d.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_size_t] * 5
_lib.ggml_backend_tensor_get_2d.restype = None

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

Alloc = Callable[[int], "bytearray | memoryview"]
"""Where a state is written: ``alloc(n)`` returns a writable buffer of ``n`` bytes."""


class KvLayoutError(RuntimeError):
    """The KV cache tensors could not be found or do not match the state layout."""


class StateReadError(RuntimeError):
    """llama.cpp wrote fewer bytes than it announced, or the fast read disagreed with it."""


def llama_state(ctx: llama.llama_context_p, seq: int) -> bytearray:
    """``llama_state_seq_get_data`` of ``seq`` into a new ``bytearray`` (run by run; slow when cells interleave)."""
    size = llama.llama_state_seq_get_size(ctx, seq)
    buf = bytearray(size)
    got = llama.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, seq)
    if got != size:
        raise StateReadError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
    return buf


class StateReader:
    """Sequence states of one context: :class:`KvReader` where it was checked, else llama.cpp.

    ``verify``: every fast read is also compared with llama.cpp's bytes (tests).
    """

    def __init__(self, ctx: llama.llama_context_p, verify: bool = False) -> None:
        self.ctx = ctx
        self.verify = verify
        self.fast: KvReader | None = None

    def enable(self, k0: int, layout: StateLayout, kv_size: int, seq: int, cells: np.ndarray) -> bool:
        """Use a :class:`KvReader` from now on if its state of ``seq`` (whose cells are ``cells``,
        by position) equals llama.cpp's; returns whether it does."""
        if not k0:
            self.fast = None
            return False
        try:
            reader = KvReader(k0, layout, kv_size)
            ok = reader.read(seq, cells) == llama_state(self.ctx, seq)
        except KvLayoutError:
            ok = False  # (e.g. layers spread over several buffer types): llama.cpp's reads
        self.fast = reader if ok else None
        return ok

    def read(self, seq: int, cells: np.ndarray | None, alloc: Alloc = bytearray) -> bytearray | memoryview:
        """The state of ``seq`` in ``llama_state_seq_get_data``'s format (the fast read writes it into
        ``alloc(n)``, a writable buffer of ``n`` bytes whose contents do not matter).

        ``cells``: ``int32[n]``, the cell of each position of ``seq``, or ``None`` when the
        mirror does not know them (llama.cpp reads).  Raises :class:`StateReadError`.
        """
        if self.fast is None or cells is None:
            return llama_state(self.ctx, seq)
        buf = self.fast.read(seq, cells, alloc)
        if self.verify and buf != llama_state(self.ctx, seq):
            raise StateReadError(f"the fast state read of seq {seq} differs from llama.cpp's")
        return buf


def _context_tensors(t0: int) -> list[int]:
    """Addresses of every tensor in the ``ggml_context`` of tensor ``t0``, from ``t0`` on."""
    obj = t0 - _OBJ_SIZE
    mem = t0 - ctypes.c_size_t.from_address(obj).value  # the context's mem_buffer
    out: list[int] = []
    while obj and len(out) < _MAX_OBJECTS:
        if ctypes.c_int.from_address(obj + _OBJ_TYPE).value == _OBJ_TENSOR:
            out.append(mem + ctypes.c_size_t.from_address(obj).value)
        obj = ctypes.c_void_p.from_address(obj + _OBJ_NEXT).value or 0
    if not out or out[0] != t0:
        raise KvLayoutError("the ggml object list does not start at cache_k_l0")
    return out


def _root(t: int) -> int:
    view = g.tensor(t).view_src
    return int(view) if view else t


class KvReader:
    """Reads sequence states of a single-stream (unified) KV cache of ``kv_size`` cells.

    ``k0`` is the address of any tensor viewing layer 0's K cache (``cache_k_l0``);
    ``layout`` is this engine's :class:`~engine.seq_state.StateLayout`.  Raises
    :class:`KvLayoutError` when a tensor is missing or differs from the layout (for
    example layers spread over several buffer types by a partial GPU offload).
    """

    def __init__(self, k0: int, layout: StateLayout, kv_size: int) -> None:
        if layout.n_stream != 1:
            raise KvLayoutError(f"{layout.n_stream} KV streams; the reader handles a unified cache")
        self.layout = layout
        self.kv_size = kv_size
        n_layer = len(layout.layers)
        names = {f"cache_k_l{il}".encode(): ("k", il) for il in range(n_layer)}
        names.update({f"cache_v_l{il}".encode(): ("v", il) for il in range(n_layer)})
        found: dict[tuple[str, int], int] = {}
        for t in _context_tensors(_root(k0)):
            key = names.get(ctypes.string_at(t + g.OFF_NAME))
            if key is not None and not g.tensor(t).view_src:
                found[key] = t
        missing = [f"cache_{w}_l{il}" for il in range(n_layer) for w in "kv" if (w, il) not in found]
        if missing:
            raise KvLayoutError(f"KV cache tensors not found: {', '.join(missing[:4])}")
        self.k = [found[("k", il)] for il in range(n_layer)]
        self.v = [found[("v", il)] for il in range(n_layer)]
        for il, ly in enumerate(layout.layers):
            k, v = g.tensor(self.k[il]), g.tensor(self.v[il])
            if k.type != ly.k_type or int(k.nb[1]) != ly.k_row_bytes or int(k.ne[1]) != kv_size or int(k.ne[2]) != 1:
                raise KvLayoutError(f"cache_k_l{il}: type {k.type} nb {list(k.nb)} ne {list(k.ne)}")
            if v.type != ly.v_type or int(v.ne[1]) != kv_size or int(v.ne[2]) != 1:
                raise KvLayoutError(f"cache_v_l{il}: type {v.type} ne {list(v.ne)}")
            if layout.v_trans and (int(v.nb[0]) != ly.v_elem_or_row_bytes or int(v.ne[0]) < ly.n_embd_v_gqa):
                raise KvLayoutError(f"cache_v_l{il}: element size {v.nb[0]} ne {list(v.ne)}")
            if not layout.v_trans and int(v.nb[1]) != ly.v_elem_or_row_bytes:
                raise KvLayoutError(f"cache_v_l{il}: row size {v.nb[1]}")
        first = g.tensor(self.k[0])
        self.host = bool(first.buffer and _lib.ggml_backend_buffer_is_host(first.buffer) and first.data)
        # host buffers are read in place: views of every tensor's bytes, made once (the tensors live
        # as long as the context)
        self._views = {t: self._host_view(t) for t in self.k + self.v} if self.host else {}

    def state_size(self, n: int) -> int:
        """Bytes of the state of a sequence of ``n`` cells."""
        return 16 + 12 * n + 8 + len(self.layout.layers) * 24 + n * self.layout.bytes_per_cell()

    def read(self, seq: int, cells: np.ndarray, alloc: Alloc = bytearray) -> bytearray | memoryview:
        """The state ``llama_state_seq_get_data(ctx, ..., seq)`` returns, written whole into
        ``alloc(size)`` (by default a new ``bytearray``; every byte is written).

        ``cells`` is ``int32[n]``: the cell of each position ``0..n-1`` of ``seq`` (the
        mirror's :meth:`~engine.cellmap.CellMap.cells`).  Raises :class:`KvLayoutError` if two
        positions share a cell or a cell is out of range.
        """
        n = len(cells)
        out = alloc(self.state_size(n) if n else 16)
        head = np.frombuffer(out, dtype="<u4", count=4)
        head[:] = (IO_MAGIC, seq & 0xFFFFFFFF, 1, n)
        if not n:
            return out
        order, lo, span, rel, dense = self._span(seq, cells)
        meta = np.frombuffer(out, dtype="<i4", count=3 * n, offset=16).reshape(n, 3)
        meta[:, 0] = order
        meta[:, 1] = 1
        meta[:, 2] = seq
        off = 16 + 12 * n
        lay = self.layout
        np.frombuffer(out, dtype="<u4", count=2, offset=off)[:] = (lay.v_trans, len(lay.layers))
        off += 8
        for il, ly in enumerate(lay.layers):
            struct_k = np.frombuffer(out, dtype=np.uint8, count=12, offset=off)
            struct_k[:4] = np.frombuffer(np.int32(ly.k_type).tobytes(), np.uint8)
            struct_k[4:] = np.frombuffer(np.uint64(ly.k_row_bytes).tobytes(), np.uint8)
            off += 12
            dst = np.frombuffer(out, dtype=np.uint8, count=n * ly.k_row_bytes, offset=off).reshape(n, ly.k_row_bytes)
            self._rows(self.k[il], ly.k_row_bytes, lo, span, rel, dense, dst)
            off += n * ly.k_row_bytes
        for il, ly in enumerate(lay.layers):
            if lay.v_trans:
                hdr = np.frombuffer(out, dtype="<u4", count=3, offset=off)
                hdr[:] = (ly.v_type & 0xFFFFFFFF, ly.v_elem_or_row_bytes, ly.n_embd_v_gqa)
                off += 12
                size = ly.n_embd_v_gqa * n * ly.v_elem_or_row_bytes
                self._columns(self.v[il], ly.v_elem_or_row_bytes, ly.n_embd_v_gqa, lo, span, rel, dense, out, off)
            else:
                hdr8 = np.frombuffer(out, dtype=np.uint8, count=12, offset=off)
                hdr8[:4] = np.frombuffer(np.int32(ly.v_type).tobytes(), np.uint8)
                hdr8[4:] = np.frombuffer(np.uint64(ly.v_elem_or_row_bytes).tobytes(), np.uint8)
                off += 12
                size = n * ly.v_elem_or_row_bytes
                dst = np.frombuffer(out, dtype=np.uint8, count=size, offset=off).reshape(n, ly.v_elem_or_row_bytes)
                self._rows(self.v[il], ly.v_elem_or_row_bytes, lo, span, rel, dense, dst)
            off += size
        return out

    def _span(self, seq: int, cells: np.ndarray) -> tuple[np.ndarray, int, int, np.ndarray, bool]:
        """``(order, lo, span, rel, dense)`` of a sequence's cells (``int32[n]`` by position, n > 0):
        the positions in cell order, the range ``lo..lo+span-1`` the cells lie in, their offsets in it
        in cell order, and whether they fill it (one run: no gather, a straight copy).  Raises
        :class:`KvLayoutError` unless they are distinct cells of the cache."""
        order = np.argsort(cells, kind="stable")
        sorted_cells = cells[order].astype(np.int64)
        if sorted_cells[0] < 0 or sorted_cells[-1] >= self.kv_size or np.any(np.diff(sorted_cells) == 0):
            raise KvLayoutError(f"seq {seq}: the mirror's cells are not distinct cells of the cache")
        lo, span = int(sorted_cells[0]), int(sorted_cells[-1] - sorted_cells[0] + 1)
        return order, lo, span, sorted_cells - lo, span == len(cells)

    def _host_view(self, t: int) -> np.ndarray:
        st = g.tensor(t)
        nbytes = int(st.nb[1]) * self.kv_size if t in self.k else int(st.ne[0] * st.nb[0]) * self.kv_size
        return np.frombuffer((ctypes.c_char * nbytes).from_address(st.data), dtype=np.uint8)

    def _rows(self, t: int, row: int, lo: int, span: int, rel: np.ndarray, dense: bool, dst: np.ndarray) -> None:
        """``dst[i] = row of cell lo + rel[i]`` of a ``[kv_size, row]``-byte tensor."""
        if self.host:
            src = self._views[t].reshape(self.kv_size, row)[lo : lo + span]
        elif dense:
            _lib.ggml_backend_tensor_get(t, dst.ctypes.data, lo * row, span * row)
            return
        else:
            src = np.empty((span, row), dtype=np.uint8)
            _lib.ggml_backend_tensor_get(t, src.ctypes.data, lo * row, span * row)
        if dense:
            dst[:] = src
        else:
            np.take(src, rel, axis=0, out=dst)

    def _columns(
        self,
        t: int,
        el: int,
        n_rows: int,
        lo: int,
        span: int,
        rel: np.ndarray,
        dense: bool,
        out: bytearray | memoryview,
        off: int,
    ) -> None:
        """Transposed V: row ``j`` of the blob holds element ``j`` of every cell, cells ascending."""
        n = len(rel)
        word = _UINT.get(el)
        if word is None:
            raise KvLayoutError(f"V element size {el} is not 1, 2, 4 or 8 bytes")
        dst = np.frombuffer(out, dtype=word, count=n_rows * n, offset=off).reshape(n_rows, n)
        if self.host:
            whole = self._views[t][: n_rows * self.kv_size * el].view(word).reshape(n_rows, self.kv_size)
            src = whole[:, lo : lo + span]
        elif dense:
            _lib.ggml_backend_tensor_get_2d(t, dst.ctypes.data, lo * el, span * el, n_rows, self.kv_size * el, n * el)
            return
        else:
            src = np.empty((n_rows, span), dtype=word)
            stride = self.kv_size * el
            _lib.ggml_backend_tensor_get_2d(t, src.ctypes.data, lo * el, span * el, n_rows, stride, span * el)
        if dense:
            dst[:] = src
        else:
            np.take(src, rel, axis=1, out=dst)
