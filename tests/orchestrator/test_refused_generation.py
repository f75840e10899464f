"""A generation the worker refuses at its start (no room in the KV cache) leaves its slot exactly
as it was: tokens, cells, ``GET /slots`` entry, and the next greedy generation (real server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import tokenize

N_CTX = 256
LONG_TEXT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(40))


@pytest.fixture
def small_cache(start_server: Callable[..., ServerProc], tmp_path: Path) -> ServerProc:
    # One slot and two spares: the unified cache has 2 windows of N_CTX cells (512), so two long
    # previews fill it and a generation that needs the slot's cells back cannot have them.
    return start_server(
        "--parallel", "1", "--spare", "2", "--ctx-size", str(N_CTX), "--park-idle", "0",
        "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip


def generate(srv: ServerProc, slot: str, ids: list[int], n: int) -> httpx.Response:
    body = {"input_ids": ids, "id_slot": slot, "max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return httpx.post(srv.url + "/api/v1/generate", json=body, timeout=300)


def slot_entry(srv: ServerProc, slot: str) -> dict[str, Any]:
    entry = {s["id"]: s for s in httpx.get(srv.url + "/slots", timeout=30).json()}[slot]
    entry.pop("idle_s")  # the time since its last use: the only field that moves by itself
    return entry


def slot_tokens(srv: ServerProc, slot: str) -> list[int]:
    r = httpx.post(f"{srv.url}/slots/{slot}", params={"action": "tokens"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_a_generation_refused_for_kv_room_leaves_the_slot_as_it_was(small_cache: ServerProc) -> None:
    srv = small_cache
    prompt = tokenize(srv.url, CHAT.format("Summarize: " + LONG_TEXT))[-200:]  # a slot of 204 tokens
    r = generate(srv, "a", prompt, 4)
    assert r.status_code == 200, r.text
    # a stored copy to compare with later (no sequence is free: the fork is made in the store)
    r = httpx.post(f"{srv.url}/slots/a", params={"action": "fork"}, json={"target": "ctl"}, timeout=60)
    assert r.status_code == 200, r.text
    time.sleep(0.5)  # the write-behind save of "a" settles
    held = slot_tokens(srv, "a")
    before = slot_entry(srv, "a")

    filler = tokenize(srv.url, LONG_TEXT)[: N_CTX - 16]
    assert len(filler) == N_CTX - 16
    previews: list[httpx.Response] = []

    def run_preview() -> None:
        body = {"input_ids": filler, "max_tokens": 16, "use_cached_context": False, "temperature": 0}
        previews.append(httpx.post(srv.url + "/api/v1/generate/preview", json=body, timeout=300))

    threads = [threading.Thread(target=run_preview) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both previews admitted: their prompts (2 x 240 tokens) take the cache
    more = held + tokenize(srv.url, " Owls")
    r = generate(srv, "a", more, 4)
    for t in threads:
        t.join()
    assert r.status_code == 503 and r.json()["error_code"] == "OOM", r.text
    assert all(p.status_code == 200 for p in previews), [p.text for p in previews]

    assert slot_tokens(srv, "a") == held
    assert slot_entry(srv, "a") == before
    # The next greedy generation reuses every cached token and matches the stored copy's.
    r = generate(srv, "a", more, 8)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["cached_tokens"] == len(held)
    ref = generate(srv, "ctl", more, 8)
    assert ref.status_code == 200, ref.text
    assert [t["token_id"] for t in got["generated_tokens"]] == [t["token_id"] for t in ref.json()["generated_tokens"]]
