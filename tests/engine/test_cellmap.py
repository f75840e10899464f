"""Unit tests of the KV cell mirror (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cellmap import CellMap, CellMapError


def test_write_copy_truncate_shift() -> None:
    cm = CellMap(64)
    cm.write(0, 0, np.array([0, 1, 2, 3, 4]))
    cm.write(1, 0, np.array([5, 6, 7]))
    cm.truncate(0, 2)
    assert cm.cells(0).tolist() == [0, 1]
    cm.copy(1, 2)
    cm.write(2, 3, np.array([2, 3]))  # the fork's new tokens land in the holes
    assert cm.cells(2).tolist() == [5, 6, 7, 2, 3]
    assert cm.cells(1).tolist() == [5, 6, 7]
    cm.shift(2, 1, 2)
    assert cm.cells(2).tolist() == [5, 2, 3]
    cm.remove(2)
    assert cm.length(2) == 0 and cm.cells(1).tolist() == [5, 6, 7]


def test_growth_and_overwrite() -> None:
    cm = CellMap(10_000)
    for p in range(0, 1000, 100):
        cm.write(3, p, np.arange(p, p + 100))
    assert cm.length(3) == 1000
    assert np.array_equal(cm.cells(3), np.arange(1000))
    cm.write(3, 500, np.array([9999]))  # re-decoding a position replaces its cell
    assert cm.cells(3)[500] == 9999 and cm.length(3) == 1000


def test_errors() -> None:
    cm = CellMap(8)
    cm.write(0, 0, np.array([1, 2]))
    with pytest.raises(CellMapError):
        cm.write(0, 5, np.array([3]))  # a gap
    with pytest.raises(CellMapError):
        cm.cells(0, 3)


def _inverse(cm: CellMap, seq: int) -> np.ndarray:
    """The cell -> position map of ``seq`` computed from scratch, a position at a time (a cell two positions name
    maps to the lower: between a move and the truncation after it)."""
    want = np.full(cm.n_cells + 1, -1, dtype=np.int32)
    for p, c in enumerate(cm.cells(seq).tolist()):
        if want[c] < 0:
            want[c] = p
    return want


def test_positions_follow_every_change_of_the_mirror() -> None:
    """The inverse (cell -> position), once built, stays equal to one computed from scratch through decodes that
    append, rewrite a position, fill the holes a shift left, truncations, shifts, cache-reuse moves, forks, restores
    and removal; the last entry is -1 (a cell of -1 maps to no position)."""
    rng = np.random.default_rng(7)
    cm = CellMap(256)
    cells = rng.permutation(256).astype(np.int32)  # cells far from position order (a restored stream)
    cm.set(0, cells[:40])
    np.testing.assert_array_equal(cm.positions(0), _inverse(cm, 0))
    steps = [
        lambda: cm.write(0, cm.length(0), cells[cm.length(0) : cm.length(0) + 3]),  # a decode's new positions
        lambda: cm.write(0, 5, cells[200:201]),  # a position written again, into another cell
        lambda: cm.truncate(0, 30),
        lambda: cm.shift(0, 4, 10),
        lambda: cm.write(0, cm.length(0), cells[10:14]),  # the shift's freed cells taken again
        lambda: cm.move(0, 12, 8, 6),
        lambda: cm.truncate(0, 14),
        lambda: cm.copy(1, 0),
        lambda: cm.write(0, cm.length(0), cells[220:230]),
    ]
    cm.set(1, cells[100:120])
    for i, step in enumerate(steps):
        step()
        got = cm.positions(0)
        np.testing.assert_array_equal(got, _inverse(cm, 0), err_msg=f"after step {i}")
        assert got[-1] == -1 and int((got >= 0).sum()) == len(np.unique(cm.cells(0)))  # a move leaves duplicates
    np.testing.assert_array_equal(cm.positions(1), _inverse(cm, 1))  # the fork's source is untouched
    cm.remove(0)
    assert cm.length(0) == 0 and int((cm.positions(0) >= 0).sum()) == 0
