"""How the orchestrator starts its engine worker: the command line, the environment, the process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from contract import protocol as proto
from contract import settings
from contract.framing import FrameStream
from contract.settings import EngineSettings
from contract.shm import RegionLender, SharedRegion
from orchestrator.engine_client.interface import EngineDeadError

log = structlog.get_logger("slotserve.engine")

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root: the folder of the ``orchestrator``, ``engine`` and ``contract`` packages."""


@dataclass(frozen=True)
class WorkerOptions:
    """How to start (or reach) the worker: its :class:`contract.settings.EngineSettings`, handed to it whole.

    ``connect``: ``tcp:host:port`` of a standalone worker instead of spawning one (which
    then runs with its own settings); ``extra_env``: added to a spawned worker's
    environment; ``python``: the interpreter that runs it (e.g. another venv's, with a
    GPU build of llama.cpp).  ``shm_bytes``: size of the region a spawned worker's token tensors
    travel through (:mod:`contract.shm`, ``--stream-shm-bytes``); 0: none, they cross the socket.
    """

    engine: EngineSettings = field(default_factory=EngineSettings)
    connect: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    python: str = field(default_factory=lambda: os.environ.get("SLOTSERVE_WORKER_PYTHON", sys.executable))
    shm_bytes: int = 0

    @property
    def shares_files(self) -> bool:
        """Whether the worker sees this process's file system (it is spawned here, not reached by
        ``connect``): slot files are then read and written by the worker itself."""
        return self.connect is None

    def env(self) -> dict[str, str]:
        """Environment of a spawned worker: this process's, plus ``extra_env``, with the checkout's root (the
        folder holding the ``engine`` and ``contract`` packages) first on ``PYTHONPATH``, so that ``python``
        runs this checkout's worker, also when it is another virtual environment's interpreter."""
        env = {**os.environ, **self.extra_env}
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def argv(self, address: str, shm_fd: int | None = None) -> list[str]:
        """Command line for a spawned worker that connects back to ``address`` (and maps the shared
        region of descriptor ``shm_fd``, which it inherits)."""
        shm = ["--shm-fd", str(shm_fd)] if shm_fd is not None else []
        return [
            self.python,
            "-m",
            "engine.worker",
            "--connect",
            address,
            "--settings",
            settings.encode(self.engine),
            *shm,
        ]


class EngineStartError(EngineDeadError):
    """The worker died or failed before ``Ready``: ``stage`` reached, ``returncode`` (``-N``: signal N)."""

    def __init__(self, message: str, stage: str, returncode: int | None) -> None:
        super().__init__(message)
        self.stage = stage
        self.returncode = returncode

    @property
    def crashed(self) -> bool:
        """True when a signal (a crash in native code: SIGSEGV, SIGABRT, SIGILL, SIGBUS) ended the worker."""
        return self.returncode is not None and self.returncode < 0 and -self.returncode != signal.SIGTERM


def describe_exit(code: int | None) -> str:
    """A process's exit status in words (``signal SIGSEGV``, ``exit status 1``)."""
    if code is None:
        return "no exit status"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit status {code}"


class WorkerProcess:
    """A spawned ``python -m engine.worker`` that connects back over a Unix socket in a private directory."""

    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.proc: asyncio.subprocess.Process | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.region: RegionLender | None = None  # the shared region of this worker (contract.shm)

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before it is spawned)."""
        return self.proc.pid if self.proc else None

    async def spawn(self, timeout: float) -> FrameStream:
        """Start the worker and return its connection; :class:`EngineStartError` when it exits
        first or does not connect within ``timeout`` seconds."""
        self._tmpdir = tempfile.TemporaryDirectory(prefix="slotserve-")
        path = str(Path(self._tmpdir.name) / "worker.sock")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[FrameStream] = loop.create_future()

        region = None
        if self.options.shm_bytes > 0:
            try:
                region = SharedRegion.create(self.options.shm_bytes)
            except OSError as exc:  # no memfd here (a seccomp profile, an old kernel): tokens go inline
                log.warning("no shared memory for the engine worker's tokens", error=str(exc))
        lender = self.region = RegionLender(region) if region is not None else None

        class Accept(FrameStream):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                if accepted.done():  # only the first connection is the worker's
                    transport.close()
                else:
                    self.region = lender
                    if lender is not None:
                        lender.release = self.release
                    accepted.set_result(self)

            def release(self, offsets: list[int]) -> None:
                with contextlib.suppress(proto.ProtocolError):  # the worker is gone, and its region with it
                    self.write(proto.encode_frame(proto.Release(0, offsets)))

        server = await loop.create_unix_server(Accept, path=path)
        env = self.options.env()
        fds = [region.fd] if region is not None and region.fd is not None else []
        try:
            argv = self.options.argv(f"unix:{path}", fds[0] if fds else None)
            self.proc = await asyncio.create_subprocess_exec(*argv, env=env, pass_fds=fds)
        finally:
            if region is not None:
                region.close_fd()  # the worker has its own copy; the mapping stays
        try:
            waited: list[asyncio.Future[Any]] = [accepted, asyncio.ensure_future(self.proc.wait())]
            done, _ = await asyncio.wait(
                waited,
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if accepted not in done:
                code = self.proc.returncode
                await self.stop()
                raise EngineStartError(f"worker exited with {describe_exit(code)} before connecting", "spawning", code)
            return accepted.result()
        finally:
            server.close()

    async def exit_status(self) -> int | None:
        """The worker's exit status once it has exited (waits up to 5 s), else None."""
        if self.proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.proc.wait(), 5)
        return None

    async def stop(self) -> None:
        """Terminate the worker (killed after 10 s) and remove its socket directory."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 10)
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
