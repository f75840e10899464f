"""A slot emptied by a context shift is parked and comes back (real server): llama.cpp's state of
an empty sequence is stored and restored like any other, not refused as ``BAD_STATE``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.conftest import ServerProc


def test_an_emptied_slot_survives_parking(start_server: Callable[..., ServerProc], tmp_path: Path) -> None:
    srv = start_server("--parallel", "1", "--ctx-size", "512", "--park-idle", "0", "--state-dir", str(tmp_path / "s"))

    def generate(slot: str, prompt: str) -> httpx.Response:
        body = {"prompt": prompt, "id_slot": slot, "max_new_tokens": 2, "temperature": 0}
        return httpx.post(srv.url + "/api/v1/generate", json=body, timeout=300)

    assert generate("a", "Hello there").status_code == 200
    n = len(httpx.post(srv.url + "/slots/a", params={"action": "tokens"}, timeout=60).json()["tokens"])
    r = httpx.post(srv.url + "/slots/a", params={"action": "context-shift"}, json={"n_keep": 0, "n_discard": n})
    assert r.status_code == 200 and r.json()["new_n_tokens"] == 0, r.text
    assert generate("b", "Hi").status_code == 200  # the one sequence goes to b: a is parked
    listing = {s["id"]: s for s in httpx.get(srv.url + "/slots", timeout=30).json()}
    assert listing["a"]["place"] == "parked" and listing["a"]["n_tokens"] == 0
    r = generate("a", "Hi again")  # restored (empty) from the store
    assert r.status_code == 200, r.text
    assert r.json()["cached_tokens"] == 0
