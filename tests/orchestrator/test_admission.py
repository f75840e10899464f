"""Fair admission (real server, ``--parallel 1``): requests wait for the engine sequence in FIFO
order, see their position, get 429 + ``Retry-After`` when the queue is full, and give their place
up when their client leaves."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.conftest import CHAT, ServerProc

LONG = 400  # tokens asked by the generation that holds the one sequence; the test cancels it when ready
RECV_S = 600  # a loaded 2-core machine decodes at a few tokens/s: only a hang should time out


class WsClient(threading.Thread):
    """One seed-000 WebSocket client in a thread, recording ``(monotonic time, event)``."""

    def __init__(self, srv: ServerProc, slot: str, max_new_tokens: int = 3) -> None:
        super().__init__(daemon=True)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.ws: ClientConnection = connect(srv.ws_url + "/api/v1/generate/stream", close_timeout=2)
        self.body = {
            "prompt": CHAT.format(f"Tell a story about {slot}."),
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "id_slot": slot,
            "request_id": slot,
        }
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        self.ws.send(json.dumps(self.body))
        try:
            while True:
                ev = json.loads(self.ws.recv(timeout=RECV_S))
                self.events.append((time.monotonic(), ev))
                self.first.set()
                if ev["type"] in ("done", "error"):
                    return
        except (ConnectionClosed, TimeoutError):
            return

    def types(self) -> list[str]:
        return [ev["type"] for _, ev in self.events]

    def when(self, kind: str) -> float:
        return next(t for t, ev in self.events if ev["type"] == kind)

    def positions(self) -> list[int]:
        return [ev["position"] for _, ev in self.events if ev["type"] == "queued"]

    def wait_positions(self, expect: list[int], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.positions() != expect and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.positions() == expect, self.events

    def cancel(self) -> None:
        """Stop this client's running generation (it ends with ``done``, ``cancelled``)."""
        self.ws.send(json.dumps({"type": "cancel"}))

    def finish(self, timeout: float = RECV_S) -> None:
        self.join(timeout)
        assert not self.is_alive(), "client still waiting"
        self.ws.close()


@pytest.fixture
def one_seq(start_server: Callable[..., ServerProc]) -> ServerProc:
    return start_server("--parallel", "1", "--ctx-size", "512", "--queue-size", "2", "--park-idle", "0")


def _hold_and_queue(srv: ServerProc, *names: str) -> list[WsClient]:
    """A long generation holding the one sequence, then one queued client per name, in order."""
    holder = WsClient(srv, "holder", LONG)
    assert holder.first.wait(RECV_S) and holder.types()[0] == "token", holder.events
    clients = [holder]
    for position, name in enumerate(names, 1):
        clients.append(WsClient(srv, name))
        clients[-1].wait_positions([position])
    return clients


def test_fifo_order_and_full_queue(one_seq: ServerProc) -> None:
    holder, first, second = _hold_and_queue(one_seq, "first", "second")
    # Full: a third waiter is refused at once, with Retry-After.
    r = httpx.post(one_seq.url + "/api/v1/generate", json={"prompt": "x", "id_slot": "third"}, timeout=30)
    assert r.status_code == 429, r.text
    assert r.json()["error_code"] == "RATE_LIMITED" and int(r.headers["retry-after"]) >= 1
    holder.cancel()
    for c in (holder, first, second):
        c.finish()
    assert holder.types()[-1] == first.types()[-1] == second.types()[-1] == "done"
    # One sequence: each starts only after the one ahead of it finished, in arrival order.
    assert holder.when("done") <= first.when("token")
    assert first.when("done") <= second.when("token")
    assert second.positions() == [2, 1]  # moved up when "first" got the sequence
    slots = {s["id"]: s for s in httpx.get(one_seq.url + "/slots", timeout=30).json()}
    assert slots["holder"]["place"] == slots["first"]["place"] == "parked"  # handed over, state kept
    assert slots["holder"]["n_tokens"] > 15  # its prompt and what it generated before the cancel


def test_leaving_frees_the_place(one_seq: ServerProc) -> None:
    holder, first, leaver = _hold_and_queue(one_seq, "first", "leaver")
    leaver.ws.close()  # the client leaves while queued
    leaver.join(10)
    # Its place is free: a newcomer queues (position 2) instead of getting 429.  Over SSE the
    # position arrives as a comment line before any event.
    with httpx.stream(
        "POST",
        one_seq.url + "/api/extra/generate/stream",
        json={"prompt": CHAT.format("Hi"), "max_new_tokens": 2, "id_slot": "sse"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        head = next(r.iter_text())
        assert head.startswith(": queued position 2"), head
    # The SSE client left too: "first" is alone in the queue and is served next.
    late = WsClient(one_seq, "late")
    late.wait_positions([2])
    holder.cancel()
    first.finish()
    late.finish()
    holder.finish()
    assert first.types()[-1] == late.types()[-1] == "done"
    assert first.when("done") <= late.when("token")
    assert leaver.types() == ["queued"]  # it never ran
    r = httpx.post(one_seq.url + "/api/v1/generate", json={"prompt": "x", "max_new_tokens": 1}, timeout=RECV_S)
    assert r.status_code == 200, r.text
