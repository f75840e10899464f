"""Run one of the pinned llama.cpp's server test files against slotserve, unchanged.

``python -m tests.compat.upstream test_completion.py [pytest args]`` copies
``tools/server/tests/unit/<file>`` of the llama.cpp that llama-cpp-python vendors into a
scratch directory beside a ``utils.py`` that is :mod:`tests.compat.upstream_utils` (llama.cpp's
own helpers with ``slotserve serve`` as the server) and llama.cpp's ``conftest.py`` fixtures
(without the model downloads), then runs pytest there and prints one line per test:
``PASSED``/``FAILED``/``SKIPPED`` and, for a failure, its first line.  docs/compat.md holds the
results with each failure's reason.  Run it with ``nice`` and one file at a time: each test
starts its own server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.compat.upstream_utils import ROOT, UPSTREAM

CONFTEST = """
import pytest
from utils import *


@pytest.fixture(autouse=True)
def stop_server_after_each_test():
    yield
    for server in set(server_instances):
        server.stop()
"""


def run(name: str, extra: list[str]) -> int:
    """Run ``unit/<name>`` against slotserve; print the per-test outcome; pytest's exit status."""
    work = Path(tempfile.mkdtemp(prefix="llama-tests-"))
    shutil.copytree(UPSTREAM / "unit", work / "unit")  # as laid out upstream: some files import others
    (work / "fixtures").symlink_to(UPSTREAM / "fixtures")
    (work / "utils.py").write_text("from tests.compat.upstream_utils import *  # noqa: F403\n")
    (work / "conftest.py").write_text(CONFTEST)
    (work / "pytest.ini").write_text("[pytest]\n")
    report = work / "report.xml"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{work}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        f"unit/{name}",
        *extra,
    ]
    with open(work / "pytest.log", "wb") as log:  # the partial record if the run is cut short
        rc = subprocess.call(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    counts = {"PASSED": 0, "FAILED": 0, "SKIPPED": 0}
    if not report.exists():
        print(f"{name}: no report (see {work / 'pytest.log'})")
        return rc
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            outcome, why = "FAILED", (failure.get("message") or "").splitlines()[0][:200]
        elif case.find("skipped") is not None:
            outcome, why = "SKIPPED", ""
        else:
            outcome, why = "PASSED", ""
        counts[outcome] += 1
        print(f"{outcome:8} {case.get('name')}  {why}")
    print(f"{name}: " + ", ".join(f"{n} {k.lower()}" for k, n in counts.items()))
    return rc


if __name__ == "__main__":
    sys.exit(0 if run(sys.argv[1], sys.argv[2:]) in (0, 1) else 2)
