"""llama-server's slot files (``?action=save|restore``) on both ways a server may reach its worker.

A spawned worker shares the orchestrator's file system and reads and writes the files itself
(``engine.state_file``); a standalone worker reached over TCP (``--worker tcp:...``) may not,
so the orchestrator reads and writes them and moves the state over the socket.  Both must give
the same files and the same continuations, and refuse the same bad files.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import CHAT, ROOT, ServerProc
from tests.damaged_files import poisoned
from tests.redis_server import free_port

PROMPT = CHAT.format("Write a short poem about the sea.")


def listening(port: int) -> bool:
    """Whether a socket listens on ``port`` (read from /proc: a probe connection would be taken
    by the worker as its orchestrator)."""
    hex_port = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        if any(hex_port in line and line.split()[3] == "0A" for line in lines):
            return True
    return False


@pytest.fixture(params=["spawned", "standalone"])
def server(request, start_server: Callable[..., ServerProc], tmp_path: Path) -> Iterator[ServerProc]:  # type: ignore[no-untyped-def]
    save = tmp_path / "slots"
    save.mkdir()
    args = ["--slot-save-path", str(save), "--no-persist"]
    if request.param == "spawned":
        yield start_server("--ctx-size", "2048", "--parallel", "2", *args)
        return
    port = free_port()
    cmd = [sys.executable, "-m", "engine.worker", "--listen", f"tcp:127.0.0.1:{port}"]
    worker = subprocess.Popen([*cmd, "-c", "2048", "-np", "2", "--spare", "1", "-t", "2"], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not listening(port):
            assert worker.poll() is None and time.monotonic() < deadline, "the standalone worker did not listen"
            time.sleep(0.1)
        yield start_server("--worker", f"tcp:127.0.0.1:{port}", *args)
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def post(srv: ServerProc, path: str, body: dict, status: int = 200) -> dict:  # type: ignore[type-arg]
    r = httpx.post(srv.url + path, json=body, timeout=300)
    assert r.status_code == status, r.text
    return r.json()  # type: ignore[no-any-return]


def complete(srv: ServerProc, slot: int, prompt: str | list[int], n: int) -> dict:  # type: ignore[type-arg]
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "id_slot": slot, "cache_prompt": True,
            "return_tokens": True, "ignore_eos": True}  # fmt: skip
    return post(srv, "/completion", body)


def test_a_slot_file_restores_and_continues_alike(server: ServerProc) -> None:
    first = complete(server, 0, PROMPT, 8)
    tokens = post(server, "/slots/0?action=tokens", {})["tokens"]
    saved = post(server, "/slots/0?action=save", {"filename": "sea.bin"})
    assert saved["n_saved"] == len(tokens) and saved["n_written"] > 4 * len(tokens)
    restored = post(server, "/slots/1?action=restore", {"filename": "sea.bin"})
    assert (restored["n_restored"], restored["n_read"]) == (len(tokens), saved["n_written"])
    assert post(server, "/slots/1?action=tokens", {})["tokens"] == tokens
    a = complete(server, 0, tokens, 6)
    b = complete(server, 1, tokens, 6)
    assert b["timings"]["prompt_n"] <= 1, "the restored cells are used"
    assert a["tokens"] == b["tokens"] and first["tokens"]


def test_bad_slot_files_are_refused_and_change_nothing(server: ServerProc, tmp_path: Path) -> None:
    complete(server, 0, PROMPT, 4)
    n_good = post(server, "/slots/0?action=save", {"filename": "good.bin"})["n_saved"]
    post(server, "/slots/0?action=erase", {})  # its sequence free for new-slot (no store to park in)
    data = (tmp_path / "slots" / "good.bin").read_bytes()
    (tmp_path / "slots" / "cut.bin").write_bytes(data[:-64])
    (tmp_path / "slots" / "junk.bin").write_bytes(b"not a slot file")
    (tmp_path / "slots" / "nan.bin").write_bytes(poisoned(data, -1))  # a NaN in the last layer's V
    complete(server, 1, CHAT.format("Count to ten."), 3)
    before = post(server, "/slots/1?action=tokens", {})["tokens"]
    bad = (("cut.bin", "BAD_STATE"), ("junk.bin", "BAD_STATE"), ("nan.bin", "BAD_STATE"),
           ("missing.bin", "INVALID_REQUEST"))  # fmt: skip
    for name, code in bad:  # slot 1 holds cells (tested before it changes), new-slot none (tested as written)
        for slot in ("1", "new-slot"):
            err = post(server, f"/slots/{slot}?action=restore", {"filename": name}, 400)
            assert err["error_code"] == code, (name, err)
            assert name != "nan.bin" or "NaN" in err["error"]["message"], err
    assert post(server, "/slots/1?action=tokens", {})["tokens"] == before
    assert complete(server, 1, before, 2)["timings"]["prompt_n"] <= 1, "slot 1 kept its cells"
    restored = post(server, "/slots/new-slot?action=restore", {"filename": "good.bin"})  # the same cells, good
    assert restored["n_restored"] == n_good
    post(server, "/slots/new-slot?action=erase", {})
    slots = httpx.get(server.url + "/slots", timeout=30).json()
    assert all(str(s["id"]) != "new-slot" for s in slots), "a refused restore creates no slot"
    err = post(server, "/slots/1?action=save", {"filename": "../escape.bin"}, 400)
    assert err["error_code"] == "INVALID_REQUEST"
