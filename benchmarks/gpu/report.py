"""Join one device check's results into one JSON and one markdown table (benchmarks/gpu/check.sh).

Usage: ``python benchmarks/gpu/report.py LOGDIR [--json PATH]``; prints the markdown table.  ``LOGDIR`` holds
what ``check.sh device`` wrote: ``device.txt`` (nvidia-smi's name, memory, driver, compute capability),
``build.txt`` (the CMake arguments and ``build_s=`` seconds), ``check.txt`` (``check_rc=`` ``check_s=``),
``check.log`` (``slotserve check``'s lines), ``bench.json`` (``bench_table.py --json``: rows of
``row``, ``slotserve``, ``llama_server``, ``ratio`` as printed) and ``bench_lean.json`` (the one-stream rows again
with ``--capture-graph lean``).  A missing file gives an empty section.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _pairs(text: str) -> dict[str, str]:
    """``key=value`` words of ``text``."""
    return dict(re.findall(r"(\w+)=(\S+)", text))


def collect(logdir: Path) -> dict[str, Any]:
    """Everything the markdown shows: ``device``, ``build`` (``cmake_args``, ``build_s``), ``check``
    (``rc``, ``s``, ``lines``: its last 40 lines), ``rows`` (bench_table's) and ``lean_rows`` (its one-stream
    rows with ``--capture-graph lean``)."""
    build = _text(logdir / "build.txt")
    check = _pairs(_text(logdir / "check.txt"))
    bench = json.loads(_text(logdir / "bench.json") or "{}")
    lean = json.loads(_text(logdir / "bench_lean.json") or "{}")
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
        "lean_rows": lean.get("rows", []),
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: a header of device, build and check, then bench_table's rows (the lean graph's
    marked ``[--capture-graph lean]``)."""
    out = [
        f"Device: {report['device'] or 'unknown'}",
        f"Build: {report['build']['build_s'] or '?'} s ({report['build']['cmake_args']})",
        f"slotserve check: exit {report['check']['rc']} in {report['check']['s']} s",
        "",
        "| row | slotserve | llama-server | ratio |",
        "|---|---|---|---|",
    ]
    lean = [{**r, "row": r["row"] + " [--capture-graph lean]"} for r in report.get("lean_rows", [])]
    for r in report["rows"] + lean:
        cells = (r["row"], r["slotserve"], r["llama_server"], r["ratio"])
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
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
