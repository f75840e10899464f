"""benchmarks/gpu/: the device check's dry run, and its report from a device's logs.

The dry run must work here, on a machine without a GPU, without touching anything: it prints every step
of the three stages (prepare here, the build call and the run call there) and what each call carries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

CHECK = ROOT / "benchmarks" / "gpu" / "check.sh"


def _status() -> list[str]:
    """``git status`` with ignored files, but for Python's bytecode caches."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "__pycache__" not in line]


def test_the_dry_run_prints_every_step_and_the_bytes_and_changes_nothing() -> None:
    before = _status()
    out = subprocess.run(["bash", str(CHECK), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("== ")]
    for stage in ("prepare", "device call 1", "device call 2"):
        assert any(s.startswith(f"== {stage}") for s in steps), f"no {stage} step in:\n{out.stdout}"
    for what in ("SHA-256", "cmake", "llama-server", "slotserve check", "bench_table.py", "report.py"):
        assert what in out.stdout
    assert "bytes" in out.stdout and "--n-gpu-layers 99" in out.stdout
    assert _status() == before, "the dry run changed the checkout"


def test_without_a_stage_it_says_how_to_use_it() -> None:
    out = subprocess.run(["bash", str(CHECK)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--dry-run" in out.stdout


def test_the_report_joins_a_devices_logs_into_json_and_markdown(tmp_path: Path) -> None:
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 570.1, 9.0\n")
    (tmp_path / "build.txt").write_text("cmake arguments: -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90\nbuild_s=271\n")
    (tmp_path / "check.txt").write_text("check_rc=0 check_s=14\n")
    (tmp_path / "check.log").write_text("start-up ok\nattention ok\n")
    rows = [{"row": "one stream at 500 | SSE", "slotserve": "430 tok/s", "llama_server": "743", "ratio": "0.58"}]
    (tmp_path / "bench.json").write_text(json.dumps({"about": {"threads": "16"}, "rows": rows}))
    lean = [{"row": "one stream at 500 | SSE", "slotserve": "700 tok/s", "llama_server": "743", "ratio": "0.94"}]
    (tmp_path / "bench_lean.json").write_text(json.dumps({"rows": lean}))
    (tmp_path / "capture.log").write_text("machine: 16 cores\n| checkout | context |\n| this checkout | 4000 |\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu" / "report.py"),
            str(tmp_path),
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "| one stream at 500 / SSE | 430 tok/s | 743 | 0.58 |" in out.stdout
    assert "| one stream at 500 / SSE [--capture-graph lean] | 700 tok/s | 743 | 0.94 |" in out.stdout
    assert "H100" in out.stdout and "271 s" in out.stdout and "exit 0" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["build"]["build_s"] == "271" and report["check"]["rc"] == "0"
    assert report["rows"] == rows and report["check"]["lines"] == ["start-up ok", "attention ok"]
    assert report["variants"] == {"--capture-graph lean": lean, "--stream-window 64": []}
    assert report["capture"] == ["machine: 16 cores", "| checkout | context |", "| this checkout | 4000 |"]
    assert "| this checkout | 4000 |" in out.stdout


def test_the_report_of_a_call_that_only_built(tmp_path: Path) -> None:
    (tmp_path / "build.txt").write_text("cmake arguments: -DGGML_CUDA=on\nbuild_s=300\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "report.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "300 s" in out.stdout and "| row |" in out.stdout
