"""Shared fixtures: the real model, an in-process engine, and real slotserve servers.

* ``model`` / ``engine``: the default GGUF (SmolLM2-135M) in this test process, for
  engine-level tests (cell mirror verification on).
* ``server``: ``slotserve serve`` as a subprocess on a free port with its own state
  directory and ``--slot-save-path``, talked to over HTTP/WS like a client would.
* ``start_server``: a factory for servers with other options (API key, small
  context, ``--parallel 2``, Redis...), stopped at the end of the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.redis_server import RedisServer, free_port, require_redis_server

ROOT = Path(__file__).resolve().parent.parent
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


class ServerProc:
    """A running ``slotserve serve`` subprocess."""

    def __init__(self, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.args = args
        self.workdir = workdir
        self.env = {**os.environ, **(env or {})}
        self.log_path = workdir / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start_process(self) -> None:
        """Start ``slotserve serve`` without waiting for it."""
        cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(self.port), *self.args]
        if "--state-dir" not in self.args and "--redis-url" not in self.args:
            # never the user's own embedded store (~/.local/state/slotserve): this test's directory
            cmd += ["--state-dir", str(self.workdir / f"state-{self.port}")]
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def start(self, timeout: float = 120.0) -> ServerProc:
        """Start and wait until ``/health`` answers 200."""
        self.start_process()
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop (SIGTERM: graceful, flushes slots; SIGKILL: crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def worker_pid(self) -> int:
        """The engine worker's pid (a child of the server process)."""
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "engine.worker"], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        assert pids, "no worker process"
        return pids[0]


@pytest.fixture(scope="session")
def model_path() -> Path:
    from engine.model import default_model_path

    return default_model_path()


def with_chat_template(model_path: Path, template: str, out: Path) -> Path:
    """Write ``out``: a copy of the GGUF ``model_path`` with ``template`` (Jinja) as its ``tokenizer.chat_template``,
    by gguf-py's ``gguf_new_metadata`` script (``--chat-template-file``, the template written beside ``out``).
    Returns ``out``; raises :class:`subprocess.CalledProcessError` when the script fails."""
    template_file = out.parent / "t.jinja"
    template_file.write_text(template)
    cmd = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(model_path), str(out)]
    subprocess.run([*cmd, "--chat-template-file", str(template_file), "--force"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def model(model_path: Path):  # type: ignore[no-untyped-def]
    from engine.model import Model

    m = Model(model_path)
    yield m
    m.close()


@pytest.fixture(scope="session", params=["off", "on"], ids=["fa-off", "fa-on"])
def engine(model, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The engine of the engine tests, once with flash attention off (V transposed, rows from the softmax:
    the CPU default) and once on (V stored by rows, rows from the side branch: the GPU default)."""
    from contract.settings import EngineSettings
    from engine.engine import Engine

    settings = EngineSettings(
        n_ctx=2048, n_slots=4, n_spare=2, n_threads=2, verify_cells=True, flash_attn=request.param
    )
    eng = Engine(model, settings)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("server")
    srv = ServerProc(
        [
            "--parallel",
            "4",
            "--spare",
            "2",  # two spares (not the default one): n = 2 choices and two previews at once
            "--ctx-size",
            "2048",
            "--threads",
            "2",
            "--verify-cells",
            "--state-dir",
            str(work / "state"),
            "--slot-save-path",
            str(work / "slots"),
            "--max-body",
            str(4 << 20),
        ],
        work,
    ).start()
    yield srv
    srv.stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProc]]:
    started: list[ServerProc] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProc:
        srv = ServerProc(["--threads", "2", "--verify-cells", *args], tmp_path, env).start()
        started.append(srv)
        return srv

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free port, shared by the session (tests isolate by key prefix)."""
    require_redis_server()
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server for one test (which may stop and restart it)."""
    require_redis_server()
    srv = RedisServer(tmp_path / "redis")
    srv.start()
    yield srv
    srv.stop()
