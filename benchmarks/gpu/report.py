"""Join one device check's results into one JSON and one markdown table (benchmarks/gpu/check.sh).

Usage: ``python benchmarks/gpu/report.py LOGDIR [--json PATH]``; prints the markdown table.  ``LOGDIR`` holds
what ``check.sh device`` wrote: ``device.txt`` (nvidia-smi's name, memory, driver, compute capability),
``build.txt`` (the CMake arguments and ``build_s=`` seconds), ``check.txt`` (``check_rc=`` ``check_s=``),
``check.log`` (``slotserve check``'s lines), ``bench.json`` (``bench_table.py --json``: rows of
``row``, ``slotserve``, ``llama_server``, ``ratio`` as printed), the one-stream rows again with one server
setting changed (:data:`VARIANTS`) and ``capture.log`` (``bench_capture.py``'s table: decode step time by
attention format, in process).  A missing file gives an empty section.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

VARIANTS = {"--capture-graph lean": "bench_lean.json", "--stream-window 64": "bench_window.json"}
"""The settings the check runs the one-stream rows again with, and the ``bench_table.py --json`` file of each."""


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _pairs(text: str) -> dict[str, str]:
    """``key=value`` words of ``text``."""
    return dict(re.findall(r"(\w+)=(\S+)", text))


def collect(logdir: Path) -> dict[str, Any]:
    """Everything the markdown shows: ``device``, ``build`` (``cmake_args``, ``build_s``), ``check``
    (``rc``, ``s``, ``lines``: its last 40 lines), ``rows`` (bench_table's), ``variants`` (setting -> its
    one-stream rows, :data:`VARIANTS`) and ``capture`` (bench_capture's table lines)."""
    build = _text(logdir / "build.txt")
    check = _pairs(_text(logdir / "check.txt"))
    bench = json.loads(_text(logdir / "bench.json") or "{}")
    args = re.search(r"cmake arguments: (.*)", build)
    return {
        "device": _text(logdir / "device.txt").strip(),
        "build": {"cmake_args": args.group(1) if args else "", "build_s": _pairs(build).get("build_s")},
        "check": {
            "rc": check.get("check_rc"),
            "s": check.get("check_s"),
            "lines": _text(logdir / "check.log").splitlines()[-40:],
        },
        "about": bench.get("about", {}),
        "rows": bench.get("rows", []),
        "variants": {k: json.loads(_text(logdir / f) or "{}").get("rows", []) for k, f in VARIANTS.items()},
        "capture": [line for line in _text(logdir / "capture.log").splitlines() if line.startswith(("machine:", "|"))],
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: a header of device, build and check, then bench_table's rows (each variant's
    marked with its setting in brackets), then bench_capture's table."""
    out = [
        f"Device: {report['device'] or 'unknown'}",
        f"Build: {report['build']['build_s'] or '?'} s ({report['build']['cmake_args']})",
        f"slotserve check: exit {report['check']['rc']} in {report['check']['s']} s",
        "",
        "| row | slotserve | llama-server | ratio |",
        "|---|---|---|---|",
    ]
    marked = [{**r, "row": f"{r['row']} [{k}]"} for k, rows in report.get("variants", {}).items() for r in rows]
    for r in report["rows"] + marked:
        cells = (r["row"], r["slotserve"], r["llama_server"], r["ratio"])
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    if report.get("capture"):
        out += ["", "In process, decode step time by attention format (bench_capture.py):", "", *report["capture"]]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logdir", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="write the collected report here")
    a = ap.parse_args()
    report = collect(a.logdir)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    sys.stdout.write(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
