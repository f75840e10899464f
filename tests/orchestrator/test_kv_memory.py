"""The engine worker's resident memory follows the tokens its slots hold, not ``--ctx-size`` (real server).

llama.cpp allocates and clears every sequence's KV stream when the context is made; the engine gives
an empty stream's pages back (``Engine.release``, libllama's ``llama_attn_kv_seqs_release``) after its
start-up self-check, and a few seconds (``engine.kv_release.RELEASE_DELAY_S``) after a slot is erased or parked
or a preview's spare sequence is given back.
Measured as the worker's resident anonymous memory (``RssAnon`` of ``/proc/PID/status``, proc(5)).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from engine.kv_release import RELEASE_DELAY_S
from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import tokenize

N_CTX = 8192
STREAMS = 3  # --parallel 2 --spare 1
TEXT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(30))


def rss_anon(pid: int) -> int:
    """Resident anonymous memory of process ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for {pid}")


def within_release_delay(check: Callable[[], bool]) -> bool:
    """Whether ``check()`` holds within the release delay and a few seconds more (polled)."""
    deadline = time.monotonic() + RELEASE_DELAY_S + 10
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_worker_memory_follows_the_tokens_held(start_server: Callable[..., ServerProc], tmp_path: Path) -> None:
    srv = start_server(
        "--parallel", "2", "--spare", "1", "--ctx-size", str(N_CTX), "--park-idle", "0",
        "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip
    worker = srv.worker_pid()
    ids = tokenize(srv.url, CHAT.format("Summarize: " + TEXT))
    body = {"input_ids": ids, "id_slot": "a", "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.url + "/api/v1/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    saved = httpx.post(
        f"{srv.url}/slots/a", params={"action": "save-state"}, headers={"Accept": "application/octet-stream"}
    )
    assert saved.status_code == 200, saved.text
    n_tokens = len(ids) + 1  # the last generated token is not in the KV cache yet
    per_token = len(saved.content) / n_tokens  # K/V bytes of one cell, plus a little per-state overhead
    stream = per_token * N_CTX

    # every stream allocated and cleared by llama.cpp; the empty ones were given back at start
    assert rss_anon(worker) < STREAMS * stream / 2, (rss_anon(worker), STREAMS * stream)

    # a preview copies slot a's whole stream into the spare sequence, which is given back afterwards
    before = rss_anon(worker)
    pv = {
        "append_tokens": [{"token_id": t} for t in ids[-3:]],
        "max_tokens": 3,
        "temperature": 0,
        "conversation_id": "a",
    }
    r = httpx.post(srv.url + "/api/v1/generate/preview", json=pv, timeout=300)
    assert r.status_code == 200, r.text
    assert within_release_delay(lambda: rss_anon(worker) - before < stream / 2), (rss_anon(worker) - before, stream)

    # erasing slot a gives back the pages its cells were written to
    before = rss_anon(worker)
    r = httpx.post(f"{srv.url}/slots/a", params={"action": "erase"}, timeout=60)
    assert r.status_code == 200, r.text
    freed = n_tokens * per_token / 2
    assert within_release_delay(lambda: before - rss_anon(worker) >= freed), (before - rss_anon(worker), freed * 2)
