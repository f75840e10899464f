"""Run the shipped HAProxy configuration (deploy/haproxy.cfg) for a test, on a free port.

``HAProxy(nodes)`` starts Debian's ``haproxy`` in the foreground with ``SLOTSERVE_NODE1..3`` set to
``nodes`` (``host:port``; a node that is down from the start is allowed: its health checks fail)
and waits until it accepts connections.  ``require_haproxy()`` skips the test where ``haproxy`` is
not installed (``apt-get install -y haproxy``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

import pytest

from tests.redis_server import free_port

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"


def require_haproxy() -> str:
    """Path of ``haproxy``; skips the test if it is not installed."""
    path = shutil.which("haproxy")
    if path is None:
        pytest.skip("haproxy is not installed (apt-get install -y haproxy)")
    return path


class HAProxy:
    """deploy/haproxy.cfg in front of ``nodes`` (at most 3 ``host:port``; missing ones point nowhere)."""

    def __init__(self, nodes: list[str], log_path: Path) -> None:
        self.executable = require_haproxy()
        self.port = free_port()
        dead = [f"127.0.0.1:{free_port()}" for _ in range(3 - len(nodes))]
        self.env = {
            **os.environ,
            "SLOTSERVE_PROXY_BIND": f"127.0.0.1:{self.port}",
            **{f"SLOTSERVE_NODE{i + 1}": n for i, n in enumerate([*nodes, *dead])},
        }
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> Self:
        """Check the configuration, start, and wait until the port accepts connections."""
        subprocess.run([self.executable, "-c", "-q", "-f", str(CONFIG)], env=self.env, check=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [self.executable, "-db", "-f", str(CONFIG)], env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
