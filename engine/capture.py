"""Attention capture: the requested tokens' post-softmax rows, computed in llama.cpp's graph.

slotserve's libllama patch (``libllama/llama-attn.h``, bound in :mod:`engine.native`) adds, to
every attention layer of each ubatch's graph, nodes that gather the post-softmax rows of the
tokens named before ``llama_decode`` (with flash attention on: recompute them for those tokens
only, softmax(Q·Kᵀ·scale + mask) with the same soft-capping, ALiBi and sinks) and reduce them as
asked: every selected layer and head (``per_layer``) or their mean (``aggregated``), in float32
or float16.  The result is one output tensor per KV cache, read once per ubatch; no eval
callback, one graph per decode.  A decode step (one token per KV stream, ``per_layer``) has no
gather in the graph: each layer's post-softmax tensor is an output, read in place on a CPU backend
(``llama_attn_row.layers``, valid until the next decode), so :meth:`AttentionCapture.collect` reads
it through numpy views and gathers each layer once, straight into the row it hands on.  That row's memory
is recycled (:meth:`contract.buffers.BufferPool.array`): a token's full rows are megabytes (4.3 MB for
SmolLM2-135M at 4,000 tokens), and a fresh allocation of that size is faulted in and zeroed page by page on
every token; a recycled one is reused once whoever sent or read the row let go of it.

Rows come indexed by KV cell of the token's sequence's stream.  Clients want them by input
position (``attention[i]`` belongs to ``input_ids[i]``), so :meth:`AttentionCapture.collect`
gathers each row through the cell mirror (:class:`~engine.cellmap.CellMap`, fed with the cells
llama.cpp's KV cache reports for every decoded token: ``llama_attn_seq_cells``).

One format per decode: when the rows of one decode ask for different formats, dtypes or layers,
the graph computes every asked layer per head in float32 and each row is reduced here
(:func:`shape_attention`).  The formats the graph does not compute (``topk`` with a ``sink`` or k above
``max_top_k``, ``spans``, a head subset, the sink figure) are reduced from its rows by :mod:`engine.reduce`
(:meth:`RowTarget.finish`); the graph's own top k is mapped from cells to positions here
(:meth:`AttentionCapture._top_k`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from contract.buffers import BufferPool
from contract.options import AttentionDtype, AttentionFormat, CaptureOptions
from engine import native
from engine.cellmap import CellMap, CellMapError, inverse
from engine.reduce import graph_format, reduce_rows, select_top_k

_DTYPES = {native.GGML_TYPE_F32: np.float32, native.GGML_TYPE_F16: np.float16}

_NATIVE_FORMATS = {"per_layer": native.PER_LAYER, "aggregated": native.MEAN, "topk": native.TOP_K}
"""The graph formats (:func:`engine.reduce.graph_format`) as ``enum llama_attn_format``."""

_POINTER = ctypes.sizeof(ctypes.c_void_p)

ROWS_KEPT = 2
"""Row buffers kept for reuse: a token's rows are usually written out before the next decode ends."""


class CaptureError(RuntimeError):
    """llama.cpp did not capture a requested row (a graph the capture does not understand)."""


def shape_attention(out: np.ndarray, fmt: AttentionFormat, dtype: AttentionDtype) -> np.ndarray:
    """Rows ``float32[L, H, n_ctx]`` in ``fmt`` and ``dtype``: ``aggregated`` is the mean over the
    layers and heads, ``[n_ctx]``."""
    arr = out.mean(axis=(0, 1), dtype=np.float32) if fmt == "aggregated" else out
    return arr.astype(np.float16) if dtype == "float16" else arr


@dataclass
class RowTarget:
    """One row to capture: batch entry ``batch_index`` of ``seq``, the token at position ``pos``.

    ``layers`` are the requested layer indices in the request's order; ``format`` and ``dtype`` what the
    graph computes for it (:func:`engine.reduce.graph_format`).  After the decode ``out`` is
    ``[len(layers), n_head, pos+1]`` (``per_layer``) or ``[pos+1]`` (``aggregated``) of ``dtype``,
    ``out[..., p]`` the attention to position ``p`` of the sequence; with a ``reduce`` request
    (``CaptureOptions.reduced``) ``out`` is its reduction (:func:`engine.reduce.reduce_rows`),
    ``positions`` the ``int32`` positions of ``topk`` and ``sink`` the sink figure.
    """

    batch_index: int
    seq: int
    pos: int
    layers: tuple[int, ...]
    format: AttentionFormat = "per_layer"
    dtype: AttentionDtype = "float32"
    out: np.ndarray | None = None
    reduce: CaptureOptions | None = None
    positions: np.ndarray | None = None
    sink: float | None = None

    @classmethod
    def of(
        cls, seq: int, pos: int, cap: CaptureOptions, attention_layers: Sequence[int], max_top_k: int = 0
    ) -> RowTarget:
        """The target of ``cap`` for the token of ``seq`` at ``pos`` (batch index set by the decode);
        ``cap.layers`` None: every layer of ``attention_layers`` (the model's layers with attention);
        ``max_top_k``: the largest ``topk`` the graph selects (:attr:`AttentionCapture.max_top_k`)."""
        layers = tuple(attention_layers) if cap.layers is None else tuple(cap.layers)
        fmt, dtype = graph_format(cap, max_top_k)
        return cls(-1, seq, pos, layers, fmt, dtype, reduce=cap if cap.reduced else None)

    def finish(self) -> None:
        """Reduce ``out`` as ``reduce`` asks (no-op without): from the full rows, or, where the graph selected
        the top ``k`` (``positions`` set by :meth:`AttentionCapture.collect`), from those."""
        if self.reduce is None or self.out is None:
            return
        if self.positions is not None:
            red = select_top_k(self.out, self.positions, self.reduce, self.pos + 1)
        else:
            red = reduce_rows(self.out, self.reduce)
        self.out, self.positions, self.sink = red.weights, red.positions, red.sink


class AttentionCapture:
    """Drives the patch's capture on one llama context: :meth:`plan` before ``llama_decode``,
    :meth:`collect` after it.

    The context's capture is armed already (``llama_attn_init``, by :func:`engine.memory.memory_of`,
    which also counts its ``n_caches`` KV caches).  ``verify``: every collected row's cells are also
    checked against llama.cpp's KV cache (``--verify-cells``; :class:`CellMapError` on a difference).
    ``stable``: every decode carries the capture's nodes, so decodes with and without rows asked share one
    graph (:func:`engine.backend.stable_capture_graph`).  Raises
    :class:`engine.native.PatchMissingError` without the patch.
    """

    def __init__(
        self, ctx: int, cellmap: CellMap, n_layer: int, n_caches: int, verify: bool = False, stable: bool = False
    ) -> None:
        native.require_patch()
        self.ctx = ctx
        self.rows = BufferPool(keep=ROWS_KEPT)  # the per-layer rows handed on, recycled once nothing views them
        self.stable = stable  # one graph shape with and without rows asked (llama_attn_set_stable)
        if native.lib.llama_attn_set_stable(ctx, stable) != 0:
            raise CaptureError("llama_attn_set_stable refused: the context's capture is not armed")
        self.cellmap = cellmap
        self.n_layer = n_layer
        self.verify = verify
        self.n_caches = n_caches
        self.layer_cache = [native.lib.llama_attn_layer_cache(ctx, il) for il in range(n_layer)]
        self.attention_layers = tuple(il for il, c in enumerate(self.layer_cache) if c >= 0)
        self.max_top_k = int(native.lib.llama_attn_max_top_k(ctx))  # the largest k the graph selects
        self._format: tuple[int, int, tuple[int, ...], int] = (-1, -1, (), 0)
        self._row = native.AttnRow()
        self._idx = np.zeros(0, dtype=np.int32)
        self._kept_views: dict[int, tuple[tuple[object, ...], np.ndarray | list[np.ndarray]]] = {}
        self._layers_of: list[list[int]] = []  # per KV cache: indices into the format's layers of its own

    @property
    def graph_format(self) -> int:
        """The ``enum llama_attn_format`` the last capturing decode's graph computed (-1 before any)."""
        return self._format[0]

    # -- before the decode ----------------------------------------------------------------

    def plan(self, targets: Sequence[RowTarget]) -> None:
        """Name the batch rows of ``targets`` for the next ``llama_decode`` and choose its format
        (the targets' own when they agree, else every asked layer per head in float32).  No rows after a
        decode that named none calls nothing (llama.cpp's capture holds none already): a decode step without
        attention costs no ctypes call here."""
        if not targets and not len(self._idx):
            return
        if targets:
            first = targets[0]
            same = all((t.format, t.dtype, t.layers) == (first.format, first.dtype, first.layers) for t in targets)
            top_k = 0
            if same:
                fmt = _NATIVE_FORMATS[first.format]
                typ = native.GGML_TYPE_F16 if first.dtype == "float16" else native.GGML_TYPE_F32
                layers = tuple(sorted(set(first.layers)))
                if fmt == native.TOP_K:  # each takes the first of the largest k asked (best first)
                    top_k = max(t.reduce.top_k for t in targets if t.reduce is not None)
            else:
                fmt, typ = native.PER_LAYER, native.GGML_TYPE_F32
                layers = tuple(sorted({il for t in targets for il in t.layers}))
            if (fmt, typ, layers, top_k) != self._format:
                mask = np.zeros(self.n_layer, dtype=np.uint8)
                mask[list(layers)] = 1
                if native.lib.llama_attn_set_format(self.ctx, mask.ctypes.data, self.n_layer, fmt, typ, top_k) != 0:
                    raise CaptureError(f"llama_attn_set_format refused format {fmt}, type {typ}, k {top_k}")
                self._format = (fmt, typ, layers, top_k)
                caches = range(max(1, self.n_caches))
                self._layers_of = [[j for j, il in enumerate(layers) if self.layer_cache[il] == c] for c in caches]
        self._idx = np.fromiter((t.batch_index for t in targets), dtype=np.int32, count=len(targets))
        if native.lib.llama_attn_set_rows(self.ctx, self._idx.ctypes.data, len(self._idx)) != 0:
            raise CaptureError("llama_attn_set_rows refused the batch indices")

    # -- after the decode -----------------------------------------------------------------

    def n_captured(self) -> int:
        """Layers whose rows the last capturing ubatch's graph gathered (-1 after a capture error)."""
        return int(native.lib.llama_attn_n_captured(self.ctx))

    def collect(self, targets: Sequence[RowTarget]) -> None:
        """Fill each target's ``out`` from the rows the decode captured (targets in :meth:`plan`'s order).

        Raises :class:`CaptureError` for a row llama.cpp did not capture and :class:`CellMapError`
        when the mirror lacks the row's positions (or, with ``verify``, disagrees with llama.cpp).
        """
        fmt, typ, layers, _ = self._format
        for i, tg in enumerate(targets):
            cells = self.cellmap.cells(tg.seq, tg.pos + 1)
            if self.verify:
                self._verify(tg.seq, cells)
            if fmt == native.TOP_K:
                weights, positions = self._top_k(i, tg.seq, cells)  # [len(layers), H, k] each
                if tg.layers != layers:
                    order = [layers.index(il) for il in tg.layers]
                    weights, positions = weights[order], positions[order]
                tg.out, tg.positions = weights, positions
                tg.finish()
                continue
            heads = tg.reduce.heads if tg.reduce is not None and fmt == native.PER_LAYER else None
            rows = self._rows(i, tg, cells, heads)  # [len(layers), H or len(heads), pos+1] or [pos+1]
            if tg.reduce is not None and heads is not None:
                tg.reduce = msgspec.structs.replace(tg.reduce, heads=None)  # rows of those heads only
            native_format = "aggregated" if fmt == native.MEAN else "per_layer"
            exact = (native_format, "float16" if typ == native.GGML_TYPE_F16 else "float32") == (tg.format, tg.dtype)
            if exact and tuple(sorted(set(tg.layers))) == layers:
                if tg.format == "per_layer" and tg.layers != layers:
                    rows = rows[[layers.index(il) for il in tg.layers]]
                tg.out = rows
            else:
                tg.out = shape_attention(rows[[layers.index(il) for il in tg.layers]], tg.format, tg.dtype)
            tg.finish()

    def _rows(self, i: int, tg: RowTarget, cells: np.ndarray, heads: list[int] | None = None) -> np.ndarray:
        """Row ``i`` of the last decode (``tg``'s), gathered into position order: ``[n_layers, H, n]``
        with the layers of every KV cache in ascending order (``per_layer``; ``heads``: only those,
        ``[n_layers, len(heads), n]``), or their sum ``[n]`` (``aggregated``).  ``cells``: the global KV
        cache's cells of positions ``0..n-1`` (the mirror's); a sliding-window cache's come from llama.cpp's
        cell metadata (``llama_attn_seq_cells``), which holds only the recent positions: the row is 0 where it
        holds none.

        The row's memory (llama.cpp's, valid until the next decode) is read through numpy views and each
        layer is gathered once, straight into the returned array."""
        fmt, _, layers, _ = self._format
        out: np.ndarray | None = None
        for cache, held, r in self._caches(i, tg.seq, cells):
            if len(held) and (held.min() < -cache or held.max() >= r.n_kv):
                raise CellMapError(f"row {i}: cells outside the {r.n_kv} cells of its KV view")
            src = self._views(cache, r)
            if fmt == native.MEAN:
                part = np.empty(len(held), dtype=src[0].dtype)
                _gather(src[0][0], held, part)
                out = part if out is None else out + part
                continue
            if out is None:
                n_head = r.n_head if heads is None else len(heads)
                out = self.rows.array((len(layers), n_head, len(held)), src[0].dtype)  # every layer is one cache's
            mine = self._layers_of[cache]
            if isinstance(src, np.ndarray) and len(mine) == len(layers):
                _gather(src, held, out, heads)
                continue
            for j, k in enumerate(mine):
                _gather(src[j], held, out[k], heads)
        if out is None:
            raise CaptureError(f"attention row {i} has no layer in any KV cache")
        return out

    def _caches(self, i: int, seq: int, cells: np.ndarray) -> Iterator[tuple[int, np.ndarray, native.AttnRow]]:
        """Row ``i`` of the last decode in each KV cache holding a selected layer: ``(cache, cells, row)``, ``cells``
        the cache's cells of ``seq``'s positions (``cells`` given for cache 0, llama.cpp's for a sliding-window
        cache), ``row`` valid until the next iteration."""
        for cache in range(max(1, self.n_caches)):
            if cache:
                cells = seq_cells(self.ctx, seq, 0, len(cells), cache)
            status = native.lib.llama_attn_get_row(self.ctx, i, cache, ctypes.byref(self._row))
            if status == 1:
                continue  # no selected layer in this cache
            if status != 0:
                raise CaptureError(f"llama.cpp did not capture attention row {i}")
            yield cache, cells, self._row

    def _top_k(self, i: int, seq: int, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i`` of the last decode (``seq``'s) in ``TOP_K``: ``(weights float32[n_layers, H, k], positions
        int32[n_layers, H, k])``, the layers of every KV cache in ascending order, weights best first.  ``cells``:
        the global KV cache's cells of ``seq``'s positions (the mirror's).  A weight the graph found at a cell that
        holds none of those positions (a masked cell, a position past the token's) is 0 and gets position -1
        (:func:`engine.reduce.select_top_k` gives it an unused one); :class:`CellMapError` if it is not 0.

        Cells become positions through the mirror's inverse (:meth:`engine.cellmap.CellMap.positions`, kept
        up to date by each decode) for the global cache, an inverse of llama.cpp's cells for a sliding-window
        one; the CPU operator's weights come best first already (``llama_attn_set_cpu_ops``), ggml's own
        ``ggml_top_k``'s in no order and are sorted here."""
        _, _, layers, k = self._format
        weights = positions = None
        for cache, held_cells, r in self._caches(i, seq, cells):
            src = self._views(cache, r)  # per layer [H, 2k]: k weights, then their cells as float32 values
            block = src if isinstance(src, np.ndarray) else np.stack(src)  # [this cache's layers, H, 2k]
            if weights is None or positions is None:
                weights = np.empty((len(layers), r.n_head, k), np.float32)
                positions = np.empty((len(layers), r.n_head, k), np.int32)
            if cache == 0 and self.cellmap.length(seq) == len(held_cells):
                position_of = self.cellmap.positions(seq)  # [-1] is -1: a cell -1 has no position
            else:
                position_of = inverse(held_cells, int(held_cells.max(initial=-1)) + 1)
            mine = self._layers_of[cache]
            found = np.minimum(block[..., k:].astype(np.int32), len(position_of) - 1)  # -1 or past: the last entry
            weights[mine] = block[..., :k]
            positions[mine] = position_of[found]
        if weights is None or positions is None:
            raise CaptureError(f"attention row {i} has no layer in any KV cache")
        unplaced = positions < 0
        if unplaced.any() and np.any(weights[unplaced] != 0):
            raise CellMapError(f"row {i}: a top-k weight at a cell that holds none of seq {seq}'s positions")
        if bool((weights[..., :-1] >= weights[..., 1:]).all()):
            return weights, positions  # best first already (the CPU operator's order)
        order = np.argsort(-weights, axis=-1, kind="stable")  # ggml_top_k's are in no particular order
        return np.take_along_axis(weights, order, axis=-1), np.take_along_axis(positions, order, axis=-1)

    def _views(self, cache: int, r: native.AttnRow) -> np.ndarray | list[np.ndarray]:
        """:func:`_row_views` of ``r`` (row of KV cache ``cache``), the last ones again while llama.cpp's outputs
        stay where they were (a reused graph: the same addresses, shapes and strides), so a decode step's
        per-layer views are not built anew on every token (30 layers' views: ~80 µs on the project's 2-core VM)."""
        if r.nb_layer > 0:
            return _row_views(r)  # one view: as cheap as a lookup
        addresses = ctypes.string_at(ctypes.cast(r.layers, ctypes.c_void_p).value or 0, r.n_layer * _POINTER)
        key = (r.type, r.n_head, r.n_kv, r.nb_head, addresses)
        kept = self._kept_views.get(cache)
        if kept is None or kept[0] != key:
            kept = self._kept_views[cache] = (key, _row_views(r))
        return kept[1]

    def _verify(self, seq: int, cells: np.ndarray) -> None:
        theirs = seq_cells(self.ctx, seq, 0, len(cells))
        if not np.array_equal(theirs, cells):
            bad = int(np.flatnonzero(theirs != cells)[0])
            raise CellMapError(
                f"seq {seq}: the mirror has cell {cells[bad]} for position {bad}, llama.cpp's KV cache {theirs[bad]}"
            )


def _row_views(r: native.AttnRow) -> np.ndarray | list[np.ndarray]:
    """Numpy views (no copy) over a captured row's memory: one ``[n_layer, n_head, n_kv]`` array when its
    layers are one stride apart (``nb_layer``), else one ``[n_head, n_kv]`` array per layer (a decode
    step's rows read in place from each layer's graph output)."""
    dtype = np.dtype(_DTYPES[r.type])
    n_head, n_kv, es = int(r.n_head), int(r.n_kv), dtype.itemsize
    layer_bytes = (n_head - 1) * r.nb_head + n_kv * es
    if r.nb_layer > 0:
        span = (r.n_layer - 1) * r.nb_layer + layer_bytes
        buf = (ctypes.c_char * span).from_address(r.data)
        return np.ndarray((r.n_layer, n_head, n_kv), dtype, buf, strides=(r.nb_layer, r.nb_head, es))
    return [
        np.ndarray(
            (n_head, n_kv), dtype, (ctypes.c_char * layer_bytes).from_address(r.layers[k]), strides=(r.nb_head, es)
        )
        for k in range(r.n_layer)
    ]


def _gather(src: np.ndarray, cells: np.ndarray, out: np.ndarray, heads: list[int] | None = None) -> None:
    """``out[...] = src[..., cells]`` (``heads``: ``src[..., heads, cells]``, the heads axis second to last), 0
    where a cell is -1 (a position a sliding-window KV cache no longer holds); one slice copy when the cells are
    one ascending run.  ``out``: ``src``'s shape (with ``len(heads)`` heads) with ``len(cells)`` last,
    C-contiguous."""
    n = len(cells)
    if (
        n
        and int(cells[0]) >= 0
        and int(cells[-1]) - int(cells[0]) == n - 1
        and (n == 1 or bool(np.all(cells[1:] > cells[:-1])))
    ):
        run = slice(int(cells[0]), int(cells[0]) + n)
        np.copyto(out, src[..., run] if heads is None else src[..., heads, run])
        return
    if heads is not None:
        src = src[..., heads, :]
    held = cells >= 0
    every = bool(held.all())
    np.take(src, cells if every else np.where(held, cells, 0), axis=-1, out=out, mode="clip")
    if not every:
        out[..., ~held] = 0


def seq_cells(ctx: int, seq: int, p0: int, n: int, cache: int = 0) -> np.ndarray:
    """``int32[n]``: the KV cell (within its stream) of positions ``p0..p0+n-1`` of ``seq``, as
    llama.cpp's KV cache holds them (-1 where it holds no such position)."""
    out = np.empty(n, dtype=np.int32)
    if native.lib.llama_attn_seq_cells(ctx, cache, seq, p0, n, out.ctypes.data) < 0:
        raise CellMapError(f"llama_attn_seq_cells refused seq {seq} (cache {cache})")
    return out
