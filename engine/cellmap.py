"""Mirror of the KV cache's cells, kept per sequence as position -> cell.

KV cells are not positions (docs/architecture.md, "The KV cell trap"): attention rows are
indexed by the cells of the token's KV stream, the client wants them by input position.  Even in
a stream of its own a sequence's cells leave position order: a context shift removes cells in
the middle and the next tokens fill those holes first, and a restore places cells with a search
from the stream's head.  So every operation the engine issues on the cache is mirrored here:

* decode: the cells llama.cpp's KV cache holds for the decoded positions
  (``llama_attn_seq_cells``, ``libllama/llama-attn.h``: read from the cache's host-side cell
  metadata, never from the device);
* ``seq_cp`` (fork): the destination's stream is a copy of the source's, cell for cell;
* ``seq_rm``: truncation of a sequence's tail, or removal of the whole sequence;
* context shift: ``seq_rm(n_keep, n_keep+n_discard)`` + ``seq_add(..., -n_discard)``;
* cache reuse: runs of positions moved down the same way (``move``), the rest dropped;
* restore: the cells llama.cpp reports after ``llama_state_seq_set_data``.

Our sequences always hold positions ``0..n-1`` exactly once, so the mirror is an ``int32[n]``
array per sequence: ``cells(seq)[p]`` is the cell holding position ``p``.  ``--verify-cells``
compares it with llama.cpp's cells for every captured row (engine/capture.py).  The inverse, cell ->
position (:meth:`CellMap.positions`, what a row's top k found at cells needs), is built on first use and
then kept up to date by the decodes' writes and truncations; any other change drops it.
"""

from __future__ import annotations

import numpy as np


class CellMapError(RuntimeError):
    """The mirror was asked for positions a sequence does not have, or disagrees with llama.cpp."""


class CellMap:
    """Per-sequence position -> cell arrays; each sequence's cells index its stream of ``n_cells``."""

    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self._cells: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}
        self._pos: dict[int, np.ndarray] = {}  # seq -> int32[n_cells + 1]: cell -> position, built on first use

    def length(self, seq: int) -> int:
        """Number of positions (tokens) the sequence holds in the cache."""
        return self._len.get(seq, 0)

    def cells(self, seq: int, n: int | None = None) -> np.ndarray:
        """``int32[n]``: the cells of positions ``0..n-1`` of ``seq`` (a view, do not keep)."""
        length = self._len.get(seq, 0)
        n = length if n is None else n
        if n > length:
            raise CellMapError(f"seq {seq} holds {length} positions, asked for {n}")
        return self._cells[seq][:n] if n else np.empty(0, dtype=np.int32)

    def positions(self, seq: int) -> np.ndarray:
        """``int32[n_cells + 1]``: the position each cell of ``seq``'s stream holds, -1 where it holds none of
        ``seq``'s; the last entry is -1 too, so indexing with a cell of -1 gives -1.  A view, do not keep or
        write.  Built in O(length) on first use, then O(new tokens) per :meth:`write`."""
        inv = self._pos.get(seq)
        if inv is None:
            inv = self._pos[seq] = inverse(self.cells(seq), self.n_cells)
        return inv

    def write(self, seq: int, pos0: int, cells: np.ndarray) -> None:
        """A decode wrote positions ``pos0..pos0+len(cells)-1`` of ``seq`` into ``cells``."""
        length = self._len.get(seq, 0)
        if pos0 > length:
            raise CellMapError(f"seq {seq}: write at position {pos0} leaves a gap after {length}")
        end = pos0 + len(cells)
        arr = self._cells.get(seq)
        if arr is None or len(arr) < end:
            grown = np.empty(max(end, 2 * (len(arr) if arr is not None else 0), 64), dtype=np.int32)
            if arr is not None:
                grown[:length] = arr[:length]
            arr = self._cells[seq] = grown
        inv = self._pos.get(seq)
        if inv is not None:
            _unmap(inv, arr[pos0 : min(length, end)], pos0, end)  # the positions rewritten leave their old cells
            inv[cells] = np.arange(pos0, end, dtype=np.int32)
        arr[pos0:end] = cells
        self._len[seq] = max(length, end)

    def set(self, seq: int, cells: np.ndarray) -> None:
        """Replace ``seq``'s mapping (after a restore)."""
        self._cells[seq] = np.array(cells, dtype=np.int32)
        self._len[seq] = len(cells)
        self._pos.pop(seq, None)

    def copy(self, src: int, dst: int) -> None:
        """``seq_cp(src, dst, -1, -1)``: ``dst`` holds ``src``'s positions in the same cells (of its own stream)."""
        n = self._len.get(src, 0)
        self._cells[dst] = self.cells(src).copy()
        self._len[dst] = n
        self._pos.pop(dst, None)

    def truncate(self, seq: int, n: int) -> None:
        """``seq_rm(seq, n, -1)``: keep positions ``0..n-1``."""
        length = self._len.get(seq, 0)
        inv = self._pos.get(seq)
        if inv is not None and n < length:
            _unmap(inv, self._cells[seq][n:length], n, length)
        self._len[seq] = min(length, n)

    def remove(self, seq: int) -> None:
        """``seq_rm(seq, -1, -1)``."""
        self._cells.pop(seq, None)
        self._len.pop(seq, None)
        self._pos.pop(seq, None)

    def move(self, seq: int, src: int, dst: int, n: int) -> None:
        """Positions ``src..src+n-1`` shifted down to ``dst..`` (``seq_add(src, src+n, dst-src)`` after
        ``seq_rm(dst, src)``: cache reuse); positions from ``dst+n`` on are the caller's to drop."""
        arr = self._cells[seq]
        arr[dst : dst + n] = arr[src : src + n].copy()
        self._pos.pop(seq, None)

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        """Context shift: positions ``n_keep..n_keep+n_discard-1`` removed, the rest moved down."""
        arr = self.cells(seq)
        kept = np.concatenate([arr[:n_keep], arr[n_keep + n_discard :]])
        self.set(seq, kept)


def inverse(cells: np.ndarray, n_cells: int) -> np.ndarray:
    """``int32[n_cells + 1]``: the position (index into ``cells``) of each cell, -1 for a cell ``cells`` does not
    name; the last entry is -1, so indexing with a cell of -1 gives -1.  ``cells``: ``int32[n]`` cells below
    ``n_cells``, -1 where a position has none (a sliding-window cache's).  A cell two positions name (between a
    move and the truncation after it) maps to the lower, the position the move kept."""
    inv = np.full(n_cells + 1, -1, dtype=np.int32)
    held = np.flatnonzero(cells >= 0)[::-1]  # in reverse: of a cell named twice, the lower position is written last
    inv[cells[held]] = held
    return inv


def _unmap(inv: np.ndarray, cells: np.ndarray, lo: int, hi: int) -> None:
    """Positions ``lo..hi-1`` leave ``cells`` (theirs): each cell of ``inv`` (cell -> position) that maps to one of
    them maps to none; a cell another position holds too keeps that one."""
    held = inv[cells]
    inv[cells[(held >= lo) & (held < hi)]] = -1
