"""Attention capture: an eval callback that copies post-softmax rows during ``llama_decode``.

Facts this relies on (llama.cpp ``src/llama-graph.cpp``, ``ggml/src/ggml-backend.cpp``; docs/architecture.md):

* the post-softmax attention of layer ``il`` is the graph node ``kq_soft_max-{il}``,
  ``ne = [n_kv, n_tokens_in_ubatch, n_head, 1]`` (unified KV, flash attention off),
  rows already normalized over the visible cells; its ``src[1]`` is the KQ mask;
* the cells a ubatch writes are the int64 input ``attn_inp_k_idxs`` (``src[1]`` of
  layer 0's ``SET_ROWS`` into ``cache_k_l0``), one per ubatch token in batch order
  (a unified cache splits batches simply, in order);
* ``ggml_backend_sched`` asks the callback about every node (``ask=true``), splits the
  graph after the nodes we accept and calls again with ``ask=false`` once computed.

For each requested output row the row's cells are gathered into input-position order
through :class:`~engine.cellmap.CellMap`, so ``out[l, h, p]`` is the attention of the
query token to position ``p`` of its sequence.

Two paths share this plan.  With the C filter (engine/_evalfilter.c via
:mod:`engine.evalfilter`) Python sees one node per ubatch (the cells it writes) and C
copies the rows of every layer; the gather into position order happens once per row
after the decode.  Without it, every node question reaches :meth:`_on_node` and the
rows are gathered layer by layer in Python (about 1 ms more per token).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import llama_cpp as llama
import numpy as np

from engine import evalfilter
from engine import ggml_ffi as g
from engine.cellmap import CellMap, CellMapError
from engine.evalfilter import CRowCopier

_U64 = ctypes.c_uint64.from_address
_KQ_SOFT = int.from_bytes(b"kq_soft_", "little")
_CACHE_K = int.from_bytes(b"cache_k_", "little")
_L0 = b"cache_k_l0 "
_NAME = g.OFF_NAME


@dataclass
class Run:
    """``n`` consecutive batch entries ``[batch_start, batch_start+n)`` of ``seq`` at positions ``pos0..``."""

    batch_start: int
    n: int
    seq: int
    pos0: int


@dataclass
class RowTarget:
    """One output row to capture: batch entry ``batch_index`` of ``seq`` at query position ``pos``.

    ``out`` is ``float32[len(layers), n_head, pos+1]`` (filled by the callback) or
    ``None`` when only the layer-0 ``mask`` row (``float32[n_kv]``) is wanted.
    ``layer_slot[il]`` is the index in ``out`` of layer ``il`` or -1.
    """

    batch_index: int
    seq: int
    pos: int
    out: np.ndarray | None
    layer_slot: np.ndarray | None = None
    want_mask: bool = False
    mask: np.ndarray | None = None
    gather: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))


class AttentionCapture:
    """Owns the ``cb_eval`` callback of one llama context and the plan of the current decode.

    Call :meth:`begin` before ``llama_decode`` with the batch's runs (for the cell
    mirror) and the rows to capture, and :meth:`end` after it; :meth:`end` raises the
    first error the callback hit (:class:`CellMapError` when a captured row's visible
    cells disagree with the mirror and ``verify`` is on).
    """

    def __init__(self, cellmap: CellMap, n_layer: int, n_head: int, verify: bool = False, use_c: bool = True) -> None:
        self.cellmap = cellmap
        self.n_layer = n_layer
        self.n_head = n_head
        self.verify = verify
        self.callback = llama.ggml_backend_sched_eval_callback(self._on_node)
        self.c: CRowCopier | None = None
        if use_c and evalfilter.available():
            self.c = CRowCopier(self.callback, n_layer, n_head)
        self._rows_of: list[RowTarget] = []
        self._layer_of = {f"kq_soft_max-{il}".encode(): il for il in range(n_layer)}
        self._runs: list[Run] = []
        self._targets: list[RowTarget] = []
        self._ub_targets: list[RowTarget] = []
        self._ub_start = 0
        self._ub_n = 0
        self._active = False
        self._error: BaseException | None = None
        self.n_softmax_seen = 0
        self.k_cache = 0  # a node viewing layer 0's K cache (cache_k_l0), met in every decode

    @property
    def cb_eval(self) -> tuple[object, int | None]:
        """``(cb_eval, cb_eval_user_data)`` for ``llama_context_params``."""
        if self.c is not None:
            return self.c.callback, self.c.user_data
        return self.callback, None

    # -- plan ------------------------------------------------------------------------------

    def begin(self, runs: list[Run], targets: list[RowTarget]) -> None:
        """Arm the callback for the next ``llama_decode``."""
        self._runs = runs
        self._targets = sorted(targets, key=lambda t: t.batch_index)
        self._ub_targets = []
        self._ub_start = 0
        self._ub_n = 0
        self._error = None
        self.n_softmax_seen = 0
        self._active = True
        if self.c is not None:
            self._rows_of = [tg for tg in self._targets if tg.out is not None]
            n_tokens = sum(r.n for r in runs)
            cap = min(self.cellmap.n_cells, -(-(self.cellmap.high_water + 1 + n_tokens) // 256) * 256)
            forward_l0 = self.verify or any(tg.want_mask for tg in self._targets)
            self.c.arm(len(self._rows_of), cap, forward_l0)

    def end(self) -> None:
        """Disarm; gather the C-copied rows; re-raise a failure seen inside the callback."""
        self._active = False
        err, self._error = self._error, None
        if self.c is not None:
            copied = self.c.finish()
            if err is None:
                self._gather_c_rows(copied)
        if err is not None:
            raise err

    def _gather_c_rows(self, copied: int) -> None:
        if self._rows_of and copied % self.n_layer:
            raise g.GgmlLayoutError(f"copied {copied} kq_soft_max nodes, not a multiple of {self.n_layer}")
        self.n_softmax_seen = copied
        assert self.c is not None
        for i, tg in enumerate(self._rows_of):
            rows = self.c.rows(i)  # [n_layer, n_head, n_kv]
            assert tg.out is not None and tg.layer_slot is not None
            sel = np.flatnonzero(tg.layer_slot >= 0)
            order = np.empty(len(sel), dtype=np.int64)
            order[tg.layer_slot[sel]] = sel  # output layer slot -> captured layer
            src = rows if np.array_equal(order, np.arange(self.n_layer)) else rows[order]
            cells = tg.gather
            if len(cells) and cells[-1] - cells[0] == len(cells) - 1 and np.all(cells[1:] > cells[:-1]):
                np.copyto(tg.out, src[:, :, cells[0] : cells[-1] + 1])  # cells lo..hi in order: np.take is ~8x slower
            else:
                np.take(src, cells, axis=2, out=tg.out)

    # -- callback --------------------------------------------------------------------------

    def _on_node(self, t: int, ask: bool, _user: object) -> bool:
        if not self._active:
            return False
        try:
            if ask:
                head = _U64(t + _NAME).value
                if head == _KQ_SOFT:
                    return bool(self._ub_targets)
                if head == _CACHE_K and g.node_op(t) == g.GGML_OP_SET_ROWS and ctypes.string_at(t + _NAME, 11) == _L0:
                    self.k_cache = self.k_cache or (g.tensor(t).view_src or t)
                    self._new_ubatch(g.node_src(t, 1))
                return False
            self._on_softmax(t)
        except BaseException as exc:
            if self._error is None:
                self._error = exc
        return True

    def _new_ubatch(self, idxs_t: int) -> None:
        n = int(g.tensor(idxs_t).ne[0])
        idxs = g.read_array(idxs_t, np.int64, (n,))
        start = self._ub_start = self._ub_start + self._ub_n
        self._ub_n = n
        end = start + n
        for run in self._runs:
            lo, hi = max(start, run.batch_start), min(end, run.batch_start + run.n)
            if lo < hi:
                self.cellmap.write(run.seq, run.pos0 + lo - run.batch_start, idxs[lo - start : hi - start])
        self._ub_targets = [tg for tg in self._targets if start <= tg.batch_index < end]
        for tg in self._ub_targets:
            tg.gather = self.cellmap.cells(tg.seq, tg.pos + 1)
        if self.c is not None:
            self.c.set_rows(
                [(tg.batch_index - start, i) for i, tg in enumerate(self._rows_of) if start <= tg.batch_index < end]
            )

    def _on_softmax(self, t: int) -> None:
        il = self._layer_of[ctypes.string_at(t + _NAME)]
        self.n_softmax_seen += 1
        n_kv, n_tok, n_head, n_stream = g.check_contiguous_f32(t)
        if n_head != self.n_head or n_stream != 1:
            raise g.GgmlLayoutError(f"kq_soft_max-{il} has ne={[n_kv, n_tok, n_head, n_stream]}")
        c_rows = self.c is not None  # rows were copied by C: only the mask is read here
        local = sorted({tg.batch_index - self._ub_start for tg in self._ub_targets})
        where = {r: i for i, r in enumerate(local)}
        rows = None if c_rows else g.read_rows(t, local, n_head, n_tok, n_kv)  # [n_head, len(local), n_kv]
        mask = None
        for tg in self._ub_targets:
            r = tg.batch_index - self._ub_start
            if rows is not None and tg.out is not None and tg.layer_slot is not None and tg.layer_slot[il] >= 0:
                np.take(rows[:, where[r], :], tg.gather, axis=1, out=tg.out[tg.layer_slot[il]])
            if il == 0 and (tg.want_mask or self.verify):
                if mask is None:
                    mt = g.node_src(t, 1)
                    ne = g.tensor(mt).ne
                    mask = g.read_rows(mt, local, 1, int(ne[1]), int(ne[0]))[0]
                row = mask[where[r]].copy()
                if tg.want_mask:
                    tg.mask = row
                if self.verify and tg.out is not None:
                    self._verify(tg, row)

    def _verify(self, tg: RowTarget, mask_row: np.ndarray) -> None:
        visible = np.flatnonzero(np.isfinite(mask_row))
        if not np.array_equal(visible, np.sort(tg.gather)):
            raise CellMapError(
                f"seq {tg.seq} pos {tg.pos}: mask shows {visible.size} visible cells, mirror has {tg.gather.size}"
            )
