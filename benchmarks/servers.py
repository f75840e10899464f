"""Server processes for the benchmarks: slotserve and llama-server subprocesses, ports, readiness."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from common import ROOT, children
from progress import progress_bar


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model() -> Path:
    from engine.model import default_model_path

    return Path(default_model_path())


def slotserve_cmd(
    port: int,
    state_dir: Path,
    *,
    parallel: int,
    ctx_size: int,
    threads: int,
    spare: int | None = 1,
    model: Path | None = None,
    n_gpu_layers: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """``slotserve serve`` of this checkout (``python -m orchestrator.cli`` with the benchmark's interpreter,
    run from the checkout's root) on 127.0.0.1:``port`` with its embedded store in ``state_dir``
    (``spare`` None: the server's default ``--spare``)."""
    cmd = [
        sys.executable, "-m", "orchestrator.cli",
        "serve",
        "--port", str(port),
        "--state-dir", str(state_dir),
        "--parallel", str(parallel),
        "--ctx-size", str(ctx_size),
        "--threads", str(threads),
        "--n-gpu-layers", str(n_gpu_layers),
        "--log-level", "warning",
    ]  # fmt: skip
    if spare is not None:
        cmd += ["--spare", str(spare)]
    if model:
        cmd += ["--model", str(model)]
    return cmd + list(extra)


class ServerProc:
    """A server subprocess listening on ``port`` whose ``/health`` answers 200 once ready.

    ``pids()`` names it and its child processes (slotserve's engine worker) for :class:`CpuMeter`.
    """

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.worker_pid: int | None = None

    def wait_ready(self, httpx_mod, timeout: float = 300) -> float:
        """Seconds until ``/health`` answered 200; a progress bar follows the model load meanwhile
        (``/health``'s ``progress`` fraction and ``stage`` where the server reports them)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        with progress_bar() as bar:
            task = bar.add_task(f"{self.name}: starting", total=100)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    r = httpx_mod.get(self.base + "/health", timeout=2)
                    if r.status_code == 200:
                        kids = children(self.proc.pid)
                        self.worker_pid = kids[0] if kids else None
                        return time.perf_counter() - t0
                    body = r.json()
                    stage = body.get("stage") or body.get("error", {}).get("message", "starting")
                    bar.update(task, description=f"{self.name}: {stage}", completed=100 * body.get("progress", 0.0))
                except (httpx_mod.HTTPError, ValueError):
                    pass
                time.sleep(0.3)
        raise RuntimeError(f"{self.name} not healthy after {timeout}s; see {self.log_path}")

    def pids(self) -> dict[str, int]:
        out = {self.name: self.proc.pid}
        for i, pid in enumerate(children(self.proc.pid) if self.proc.poll() is None else []):
            out[f"{self.name}:child{i}"] = pid
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def stop_servers(servers: Iterable[ServerProc], tmp: Path, keep_logs: bool) -> None:
    """Stop ``servers``; then keep their work directory ``tmp`` (and say where) or remove it."""
    for srv in servers:
        srv.stop()
    if keep_logs:
        print(f"logs in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def settle(client, base: str, timeout: float = 60, slots: Sequence[str] | None = None) -> None:
    """Wait until slotserve's slots (all, or ``slots``) are idle and their write-behind saves done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = client.get(base + "/slots", timeout=30).json()
        busy = [
            s
            for s in listed
            if (slots is None or str(s.get("id")) in slots) and (s.get("is_processing") or s.get("dirty"))
        ]
        if not busy:
            time.sleep(0.1)
            return
        time.sleep(0.1)
    print(f"  warning: slots still busy/dirty after {timeout}s", flush=True)


def check(resp, what: str) -> dict:
    """The JSON body of a 2xx response; RuntimeError with the body otherwise."""
    if resp.status_code // 100 != 2:
        raise RuntimeError(f"{what}: HTTP {resp.status_code} {resp.text[:400]}")
    return resp.json()


def llama_server_cmd(
    binary: Path, model: Path, port: int, *, parallel: int, ctx_size: int, threads: int, n_gpu_layers: int,
    slot_dir: Path, extra: str = "",
) -> list[str]:  # fmt: skip
    """``llama-server`` with ``parallel`` slots of ``ctx_size`` tokens each and ``--slot-save-path slot_dir``
    (created: the slot actions, erase included, need it)."""
    slot_dir.mkdir(parents=True, exist_ok=True)
    return [
        str(binary), "-m", str(model), "-np", str(parallel), "-c", str(parallel * ctx_size), "-t", str(threads),
        "-ngl", str(n_gpu_layers), "--port", str(port), "--host", "127.0.0.1", "--slot-save-path", str(slot_dir),
        *extra.split(),
    ]  # fmt: skip
