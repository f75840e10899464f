"""A stand-in for llama.cpp's ``tools/server/tests/utils.py`` that starts slotserve instead.

The ported tests beside this file (``test_slot_save.py``, ``test_tokenize.py``) keep
llama.cpp's test code; only the server they talk to changes: ``ServerPreset.tinyllama2()``
here starts ``slotserve serve`` on a free port with the preset's settings (2 slots, 512
tokens per slot, ``n_predict`` 64, ``--slot-save-path``) on slotserve's default model.
``make_request`` and ``match_regex`` behave as llama.cpp's.

Portions (the ``make_request``/``match_regex`` interface and the preset values) follow
llama.cpp, MIT License, Copyright (c) 2023-2026 The ggml authors.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
server_instances: set[ServerProcess] = set()


class ServerResponse:
    """Status, headers and the JSON body of one response (llama.cpp's ``ServerResponse``)."""

    headers: dict[str, str]
    status_code: int
    body: Any


class ServerProcess:
    """``slotserve serve`` with llama-server's test-preset settings."""

    def __init__(self) -> None:
        self.n_ctx = 512
        self.n_slots = 2
        self.n_predict = 64
        self.seed = 42
        self.temperature: float | None = None
        self.slot_save_path: str | None = None
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir = tempfile.mkdtemp(prefix="llama-compat-")

    def start(self, timeout_seconds: float = 120) -> None:
        args = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", str(self.port),
                "--parallel", str(self.n_slots), "--ctx-size", str(self.n_ctx), "--threads", "2",
                "--n-predict", str(self.n_predict), "--state-dir", os.path.join(self.workdir, "state")]  # fmt: skip
        if self.slot_save_path:
            args += ["--slot-save-path", self.slot_save_path]
        log = open(os.path.join(self.workdir, "server.log"), "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        server_instances.add(self)
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"slotserve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.make_url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("slotserve did not become healthy")

    def stop(self) -> None:
        server_instances.discard(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.proc = None

    def make_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def make_request(self, method: str, path: str, data: Any = None, headers: dict | None = None,
                     timeout: float | None = 120) -> ServerResponse:  # fmt: skip
        body = data
        if self.temperature is not None and isinstance(data, dict) and path in ("/completion", "/completions"):
            body = {"temperature": self.temperature, "seed": self.seed, **data}  # the preset's server defaults
        r = httpx.request(method, self.make_url(path), json=body, headers=headers, timeout=timeout)
        result = ServerResponse()
        result.headers = dict(r.headers)
        result.status_code = r.status_code
        try:
            result.body = r.json()
        except ValueError:
            result.body = r.text
        return result


class ServerPreset:
    """llama.cpp's presets, served by slotserve."""

    @staticmethod
    def tinyllama2() -> ServerProcess:
        return ServerProcess()


def match_regex(regex: str, text: str) -> bool:
    return re.compile(regex, flags=re.IGNORECASE | re.MULTILINE | re.DOTALL).search(text) is not None
