"""The type checker passes: mypy, configured in pyproject.toml (``[tool.mypy]``: the packages it checks).

Among what it keeps so: every ``ApiError`` is built from an ``ErrorCode`` member, never a string
(``orchestrator/web/errors.py``), and the ASGI messages the middleware sends are complete.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_mypy_finds_no_error() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert out.stdout.startswith("Success"), out.stdout
