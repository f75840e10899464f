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
