"""benchmarks/bench_save_stall.py, run small: its rows come out with numbers (their values are not checked:
speed is the benchmark's business), and a bad flag is refused before any server starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "bench_save_stall.py"
NUM = r"(\d+(?:\.\d+)?)"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_a_small_run_prints_every_row_with_numbers() -> None:
    args = ["--tokens", "64", "--new", "8", "--reps", "1", "--ctx-size", "256"]
    args += ["--wait-idle", "0", "--max-other", "100", "--retries", "0"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=500
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "machine: " in text and "load average" in text
    head = r"four conversations of 64 tokens, full per-layer attention \(WS\), 8 new each"
    assert re.search(rf"{head}, no save: {NUM} tok/s; longest gap {NUM} ms", text), text
    for path in (r"saves through the API \(octet-stream\)", r"saves to a slot file \(\?action=save\)"):
        row = re.search(
            rf"{head}, {path} of a 64-token slot \({NUM} MB\): {NUM} tok/s = {NUM} of no save; longest gap {NUM} ms; "
            rf"{NUM} saves per window \({NUM}% of it\); a save {NUM} ms during the decode, {NUM} ms alone",
            text,
        )
        assert row, text
        assert float(row.group(1)) > 0, "a save of a 64-token slot wrote no bytes"
    # every stream's prompt was cached by the prefills (the last token is evaluated again to sample)
    assert "cached tokens [63, 63, 63, 63]" in text, text


def test_an_unknown_save_path_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--save", "api,disk"], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert out.returncode == 2 and "--save takes api, file" in out.stderr
    assert "slotserve ready" not in out.stdout
