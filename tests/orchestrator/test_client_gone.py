"""A waiting request whose client leaves ends at once and leaves no trace (real server,
``--parallel 1``): on every route that waits for a busy slot or for an engine sequence."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import tokenize
from tests.orchestrator.test_admission import LONG, RECV_S, WsClient
from tests.waiting import wait_until

HOLDER = "7"  # numeric, so llama-server's id_slot can name it too


@pytest.fixture
def one_seq(start_server: Callable[..., ServerProc], tmp_path: Path) -> ServerProc:
    return start_server(
        "--parallel", "1", "--ctx-size", "512", "--queue-size", "1", "--park-idle", "0",
        "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip


def waiting(srv: ServerProc) -> int:
    """Requests waiting for a busy slot or an engine sequence (KoboldCpp's ``perf`` ``queue``)."""
    r = httpx.get(srv.url + "/api/extra/perf", timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["queue"])


def tokens_of(srv: ServerProc, slot: str) -> list[int]:
    r = httpx.post(f"{srv.url}/slots/{slot}", params={"action": "tokens"}, timeout=RECV_S)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def leave_while_waiting(srv: ServerProc, path: str, body: dict[str, Any]) -> None:
    """POST ``body`` from a raw socket, wait until the server counts it as waiting, then close
    the connection; the server must then stop counting it within a few seconds."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", srv.port))
    try:
        sock.sendall(head.encode() + data)
        wait_until(lambda: waiting(srv) == 1, f"{path} did not wait")
    finally:
        sock.close()
    wait_until(lambda: waiting(srv) == 0, f"{path} still waits after its client left")


def hold(srv: ServerProc, slot: str) -> WsClient:
    """A long generation on ``slot`` (the engine's one sequence), running."""
    holder = WsClient(srv, slot, LONG)
    assert holder.first.wait(RECV_S) and holder.types()[0] == "token", holder.events
    return holder


def finish(holder: WsClient, srv: ServerProc) -> list[int]:
    """Cancel the holder; the tokens its slot must hold now (its prompt and what it generated)."""
    holder.cancel()
    holder.finish()
    assert holder.types()[-1] == "done", holder.events
    generated = [ev["token"]["token_id"] for _, ev in holder.events if ev["type"] == "token"]
    return tokenize(srv.url, holder.body["prompt"]) + generated  # type: ignore[arg-type]


BUSY_SLOT_WAITERS = {
    "slot action": (f"/slots/{HOLDER}?action=erase&wait=true", {}),
    "preview": ("/api/v1/generate/preview", {"conversation_id": HOLDER, "max_tokens": 4}),
    "generate": ("/api/v1/generate", {"prompt": "Hi", "id_slot": HOLDER, "wait": True, "max_new_tokens": 4}),
    "kobold sse": (
        "/api/extra/generate/stream",
        {"prompt": "Hi", "id_slot": HOLDER, "wait": True, "max_new_tokens": 4},
    ),
    "openai stream": ("/v1/completions", {"prompt": "Hi", "slot_id": HOLDER, "max_tokens": 4, "stream": True}),
    "llama-server no cache_prompt": (
        "/completion",
        {"prompt": "Hi", "id_slot": int(HOLDER), "n_predict": 4, "cache_prompt": False, "stream": True},
    ),
}


@pytest.mark.parametrize("route", list(BUSY_SLOT_WAITERS))
def test_wait_for_a_busy_slot_ends_with_its_client(one_seq: ServerProc, route: str) -> None:
    path, body = BUSY_SLOT_WAITERS[route]
    holder = hold(one_seq, HOLDER)
    leave_while_waiting(one_seq, path, body)
    expected = finish(holder, one_seq)
    # Nothing ran on the slot after the holder: not an erase, a prefill or a generation.
    assert tokens_of(one_seq, HOLDER) == expected
    assert "CLIENT_GONE" in one_seq.log()
    # and the slot serves the next request at once
    r = httpx.post(
        one_seq.url + "/api/v1/generate",
        json={"prompt": "Hi", "id_slot": HOLDER, "max_new_tokens": 2, "temperature": 0},
        timeout=RECV_S,
    )
    assert r.status_code == 200, r.text


def test_preview_queued_for_a_sequence_ends_with_its_client(one_seq: ServerProc) -> None:
    srv = one_seq
    ids = tokenize(srv.url, CHAT.format("Name a bird."))
    r = httpx.post(
        srv.url + "/api/v1/generate",
        json={"input_ids": ids, "id_slot": "pv", "max_new_tokens": 4, "temperature": 0},
        timeout=RECV_S,
    )
    assert r.status_code == 200, r.text
    holder = hold(srv, HOLDER)  # parks "pv": its preview must wait for the one sequence
    listing = {s["id"]: s for s in httpx.get(srv.url + "/slots", timeout=30).json()}
    assert listing["pv"]["place"] == "parked"
    before = tokens_of(srv, "pv")
    leave_while_waiting(srv, "/api/v1/generate/preview", {"conversation_id": "pv", "max_tokens": 4})
    # Its place in the queue (--queue-size 1) is free: the next waiter queues instead of a 429.
    late = WsClient(srv, "late")
    late.wait_positions([1])
    finish(holder, srv)
    late.finish()
    assert late.types()[-1] == "done", late.events
    listing = {s["id"]: s for s in httpx.get(srv.url + "/slots", timeout=30).json()}
    assert listing["pv"]["place"] == "parked" and listing["pv"]["n_tokens"] == len(before)
    assert tokens_of(srv, "pv") == before
    r = httpx.post(
        srv.url + "/api/v1/generate/preview",
        json={"conversation_id": "pv", "max_tokens": 2, "temperature": 0},
        timeout=RECV_S,
    )
    assert r.status_code == 200 and r.json()["cache_hit"] is True, r.text
