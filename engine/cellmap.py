"""Mirror of the unified KV cache's cells, kept per sequence as position -> cell.

KV cells are not positions (docs/architecture.md, "The KV cell trap"): after a ``seq_rm`` or a
discarded fork new tokens land in holes, and a state restore places cells with a
non-contiguous search.  Attention rows from ``kq_soft_max`` are indexed by cell, the
client wants them by input position, so every operation the engine issues on the
cache is mirrored here:

* decode: the cells written are read from ``attn_inp_k_idxs`` (see capture.py);
* ``seq_cp`` (fork): the destination shares the source's cells;
* ``seq_rm``: truncation of a sequence's tail, or removal of the whole sequence;
* context shift: ``seq_rm(n_keep, n_keep+n_discard)`` + ``seq_add(..., -n_discard)``;
* restore: the first free cells, where llama.cpp's ``find_slot`` puts them (engine.py).

Our sequences always hold positions ``0..n-1`` exactly once, so the mirror is a
``int32[n]`` array per sequence: ``cells(seq)[p]`` is the cell holding position ``p``.
"""

from __future__ import annotations

import numpy as np


class CellMapError(RuntimeError):
    """The mirror was asked for positions a sequence does not have."""


class CellMap:
    """Per-sequence position -> cell arrays for a unified KV cache of ``n_cells`` cells."""

    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self.high_water = -1  # the highest cell ever written (bounds n_kv of the next decode)
        self._cells: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}

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
        arr[pos0:end] = cells
        self._len[seq] = max(length, end)
        if len(cells):
            self.high_water = max(self.high_water, int(cells.max()))

    def set(self, seq: int, cells: np.ndarray) -> None:
        """Replace ``seq``'s mapping (after a restore)."""
        self._cells[seq] = np.array(cells, dtype=np.int32)
        self._len[seq] = len(cells)
        if len(cells):
            self.high_water = max(self.high_water, int(np.max(cells)))

    def copy(self, src: int, dst: int) -> None:
        """``seq_cp(src, dst, -1, -1)``: ``dst`` now shares all of ``src``'s cells."""
        n = self._len.get(src, 0)
        self._cells[dst] = self.cells(src).copy()
        self._len[dst] = n

    def truncate(self, seq: int, n: int) -> None:
        """``seq_rm(seq, n, -1)``: keep positions ``0..n-1``."""
        self._len[seq] = min(self._len.get(seq, 0), n)

    def remove(self, seq: int) -> None:
        """``seq_rm(seq, -1, -1)``."""
        self._cells.pop(seq, None)
        self._len.pop(seq, None)

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        """Context shift: positions ``n_keep..n_keep+n_discard-1`` removed, the rest moved down."""
        arr = self.cells(seq)
        kept = np.concatenate([arr[:n_keep], arr[n_keep + n_discard :]])
        self.set(seq, kept)

    def sharers(self, seq: int) -> list[int]:
        """Other sequences that share at least one cell with ``seq``."""
        mine = self.cells(seq)
        if not len(mine):
            return []
        return [s for s in self._len if s != seq and self._len[s] and np.intersect1d(mine, self.cells(s)).size]

    def private_cells(self, seq: int, start: int) -> int:
        """How many cells of positions ``start..`` of ``seq`` no other sequence holds."""
        tail = self.cells(seq)[start:] if start < self.length(seq) else np.empty(0, dtype=np.int32)
        if not len(tail):
            return 0
        others = np.zeros(self.n_cells, dtype=bool)
        for s, n in self._len.items():
            if s != seq:
                others[self._cells[s][:n]] = True
        return int(np.count_nonzero(~others[np.unique(tail)]))

    def runs(self, seq: int) -> int:
        """Runs of consecutive cells that ``seq`` occupies (1 when its cells are contiguous)."""
        cells = np.sort(self.cells(seq))
        return int(1 + np.count_nonzero(np.diff(cells) != 1)) if len(cells) else 0

    def occupied(self) -> np.ndarray:
        """``bool[n_cells]``: the cells that hold a position of any sequence."""
        used = np.zeros(self.n_cells, dtype=bool)
        for s, n in self._len.items():
            used[self._cells[s][:n]] = True
        return used

    def used(self) -> int:
        """Distinct cells in use by all sequences."""
        if not self._len:
            return 0
        return int(np.unique(np.concatenate([self.cells(s) for s in self._len])).size)
