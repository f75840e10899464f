"""Slot files move between llama.cpp's llama-server and slotserve, both ways, and continue greedily alike.

Needs a ``llama-server`` binary built from the llama.cpp that llama-cpp-python vendors
(docs/benchmarks.md says how); set ``LLAMA_SERVER_BIN`` to it, otherwise these tests skip.
llama-server runs with ``-fa off`` (slotserve's ``--flash-attn auto`` on a CPU: V stored transposed) and
its default ``-np`` auto (one KV stream shared by its slots), the conditions under which a file moves both
ways (docs/api.md).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProc
from tests.redis_server import free_port

BIN = os.environ.get("LLAMA_SERVER_BIN", "")
pytestmark = pytest.mark.skipif(
    not (BIN and Path(BIN).is_file()), reason="set LLAMA_SERVER_BIN to a llama-server binary to run these"
)
PROMPT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"


class LlamaServer:
    """llama-server on a free port with a slot-save directory."""

    def __init__(self, model: Path, save_dir: Path, log: Path) -> None:
        self.port = free_port()
        args = [BIN, "-m", str(model), "--port", str(self.port), "-c", "2048", "-t", "2", "-fa", "off",
                "--slot-save-path", str(save_dir) + "/", "--temp", "0"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("llama-server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def pair(start_server, model_path: Path, tmp_path: Path) -> Iterator[tuple[LlamaServer, ServerProc]]:  # type: ignore[no-untyped-def]
    save = tmp_path / "slots"
    save.mkdir()
    ls = LlamaServer(model_path, save, tmp_path / "llama-server.log")
    try:
        yield ls, start_server("--ctx-size", "2048", "--parallel", "2", "--slot-save-path", str(save))
    finally:
        ls.stop()


def complete(url: str, ids: list[int], slot: int | str, n: int = 12) -> dict:  # type: ignore[type-arg]
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "id_slot": slot, "cache_prompt": True,
            "return_tokens": True, "ignore_eos": True}  # fmt: skip
    r = httpx.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def action(url: str, slot: int | str, name: str, filename: str) -> dict:  # type: ignore[type-arg]
    r = httpx.post(f"{url}/slots/{slot}", params={"action": name}, json={"filename": filename}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_llama_server_file_restores_into_slotserve(pair: tuple[LlamaServer, ServerProc]) -> None:
    ls, ss = pair
    ids = httpx.post(ss.url + "/tokenize", json={"content": PROMPT}).json()["tokens"]
    first = complete(ls.url, ids, 0)
    saved = action(ls.url, 0, "save", "from-llama.bin")
    context = ids + first["tokens"]
    reference = complete(ls.url, context, 0)  # llama-server continues from its own cache
    restored = action(ss.url, "from-llama", "restore", "from-llama.bin")
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    ours = complete(ss.url, context, "from-llama")
    assert ours["timings"]["cache_n"] == saved["n_saved"]  # the restored KV was used, not recomputed
    assert ours["tokens"] == reference["tokens"]


def test_slotserve_file_restores_into_llama_server(pair: tuple[LlamaServer, ServerProc]) -> None:
    ls, ss = pair
    ids = httpx.post(ss.url + "/tokenize", json={"content": PROMPT}).json()["tokens"]
    first = complete(ss.url, ids, "to-llama")
    saved = action(ss.url, "to-llama", "save", "from-slotserve.bin")
    context = ids + first["tokens"]
    reference = complete(ss.url, context, "to-llama")
    restored = action(ls.url, 1, "restore", "from-slotserve.bin")
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    theirs = complete(ls.url, context, 1)
    assert theirs["timings"]["cache_n"] >= saved["n_saved"] - 1
    assert theirs["tokens"] == reference["tokens"]
