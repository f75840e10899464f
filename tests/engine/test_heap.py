"""contract.heap: blocks of hundreds of KB to MBs come from glibc's heap (reused pages), not a fresh mapping each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Where a 4 MiB block lands: in the brk heap ("[heap]" in /proc/self/maps) or in a mapping of its own.
PROBE = """
import numpy as np
from contract.heap import keep_heap_mapped
if {tune}:
    assert keep_heap_mapped()
block = np.ones(4 << 20, dtype=np.uint8)
addr = block.ctypes.data
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= addr < hi:
        print("heap" if line.rstrip().endswith("[heap]") else "own mapping")
"""


def where(tune: bool) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(tune=tune)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_per_token_sized_blocks_come_from_the_heap_once_tuned() -> None:
    assert where(False) == "own mapping", "glibc's default: a 4 MiB block is mapped (and unmapped) by itself"
    assert where(True) == "heap"
