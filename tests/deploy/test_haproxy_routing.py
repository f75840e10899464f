"""deploy/haproxy.cfg routes by slot id, consistently, with health checks (no model needed).

Three small HTTP backends stand in for slotserve nodes: each answers ``GET /health`` and echoes
its name and the slot id the proxy routed on.  The real-node version (slotserve nodes, Redis,
kill -9) is tests/deploy/test_haproxy_nodes.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.deploy.haproxy_proc import HAProxy


class Backend:
    """A stand-in node named ``name`` on a free port."""

    def __init__(self, name: str) -> None:
        self.name = name
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                body = json.dumps(
                    {
                        "node": backend.name,
                        "route": self.headers.get("X-Slotserve-Route"),
                        "hash": self.headers.get("X-Slotserve-Hash"),
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def backends() -> Iterator[list[Backend]]:
    nodes = [Backend(f"n{i}") for i in range(1, 4)]
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture
def proxy(backends: list[Backend], tmp_path: Path) -> Iterator[HAProxy]:
    with HAProxy([b.address for b in backends], tmp_path / "haproxy.log") as p:
        # the first health checks pass within a second: wait until every node has answered once
        seen: set[str] = set()
        while len(seen) < 3:
            for i in range(30):
                seen.add(route(p, "POST", "/api/v1/generate", {"id_slot": f"warm-{i}"})["node"])
        yield p


def route(p: HAProxy, method: str, path: str, body: object = None, headers: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    r = httpx.request(method, p.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def carriers(slot: str) -> list[tuple[str, str, object, dict[str, str] | None]]:
    """Every way the APIs name a slot: path, body fields, header."""
    return [
        ("POST", f"/slots/{slot}?action=tokens", None, None),
        ("GET", f"/v1/slots/{slot}/info", None, None),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": [], "slot_id": slot}, None),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": []}, {"X-Slot-Id": slot}),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": [], "user": slot}, None),
        ("POST", "/api/v1/generate", {"prompt": "hi", "conversation_id": slot}, None),
        ("POST", "/completion", {"prompt": "hi", "id_slot": slot}, None),
    ]


def test_every_way_of_naming_a_slot_reaches_the_same_node(proxy: HAProxy) -> None:
    for slot in ("alice", "bob", "chat-42", "7"):
        answers = [route(proxy, *c) for c in carriers(slot)]
        assert {a["route"] for a in answers} == {slot}, answers
        assert len({a["node"] for a in answers}) == 1, f"slot {slot!r} reached several nodes: {answers}"
    numeric = route(proxy, "POST", "/completion", {"prompt": "hi", "id_slot": 7})
    assert numeric["route"] == "7" and numeric["node"] == route(proxy, "GET", "/v1/slots/7/info")["node"]


def test_slot_ids_spread_over_the_nodes_and_anonymous_requests_follow_the_client(proxy: HAProxy) -> None:
    homes = {f"c{i}": route(proxy, "POST", "/api/v1/generate", {"id_slot": f"c{i}"})["node"] for i in range(60)}
    assert set(homes.values()) == {"n1", "n2", "n3"}, "consistent hashing spreads conversations over every node"
    anonymous = {route(proxy, "POST", "/api/v1/tokenize", {"prompt": "hi"})["node"] for _ in range(10)}
    assert len(anonymous) == 1, "requests that name no slot follow the client's address"
    slot_precedence = route(proxy, "POST", "/v1/completions", {"slot_id": "c1", "user": "c2"}, {"X-Slot-Id": "c3"})
    assert slot_precedence["route"] == "c1", "slot_id in the body wins, as in slotserve"


def test_a_dead_node_moves_only_its_own_conversations(proxy: HAProxy, backends: list[Backend]) -> None:
    homes = {f"c{i}": route(proxy, "POST", "/api/v1/generate", {"id_slot": f"c{i}"})["node"] for i in range(60)}
    backends[0].stop()  # n1 dies: after two failed health checks it leaves the ring
    moved = {s for s, n in homes.items() if n == "n1"}
    assert moved
    while True:
        now = {s: route(proxy, "POST", "/api/v1/generate", {"id_slot": s})["node"] for s in homes}
        if all(now[s] != "n1" for s in moved):
            break
        time.sleep(0.2)
    assert all(now[s] == homes[s] for s in homes if s not in moved), "the other nodes keep their conversations"


def test_conversation_keys_route_like_slot_ids_and_the_ring_hashes_the_tenant(proxy: HAProxy) -> None:
    key = {"Authorization": "Bearer tenant-a-key"}
    keyed = [
        ("POST", "/v1/chat/completions", {"messages": [], "prompt_cache_key": "conv-1"}, key),
        ("POST", "/v1/messages", {"messages": [], "metadata": {"user_id": "conv-1"}}, key),
        ("POST", "/v1/chat/completions", {"messages": []}, {**key, "X-Session-Id": "conv-1"}),
        ("POST", "/v1/chat/completions", {"messages": []}, {**key, "session_id": "conv-1"}),
        ("POST", "/v1/messages", {"messages": []}, {**key, "X-Claude-Code-Session-Id": "conv-1"}),
        ("POST", "/v1/chat/completions", {"messages": []}, {**key, "x-opencode-session": "conv-1"}),
    ]
    answers = [route(proxy, *c) for c in keyed]
    assert {a["route"] for a in answers} == {"conv-1"}, answers
    assert len({a["hash"] for a in answers}) == 1 and len({a["node"] for a in answers}) == 1, answers
    assert "tenant-a-key" not in answers[0]["hash"], "the key itself is never forwarded in the hash header"
    # explicit slot fields come first, then prompt_cache_key, then the headers (slotserve's order)
    both = route(proxy, "POST", "/v1/chat/completions", {"user": "s", "prompt_cache_key": "k"}, {"X-Session-Id": "h"})
    assert both["route"] == "s"
    assert (
        route(proxy, "POST", "/v1/chat/completions", {"prompt_cache_key": "k"}, {"X-Session-Id": "h"})["route"] == "k"
    )
    # one slot id, two tenants (two keys, or the gateway's header): two points on the ring
    hashes = [
        route(proxy, "POST", "/api/v1/generate", {"id_slot": "chat1"}, h)["hash"]
        for h in (key, {"X-Api-Key": "tenant-a-key"}, {"Authorization": "Bearer tenant-b-key"}, {"X-Tenant-Id": "acme"})
    ]
    assert hashes[0] == hashes[1], "one key is one tenant however it is sent"
    assert len(set(hashes)) == 3, hashes
    homes = {
        route(proxy, "POST", "/api/v1/generate", {"id_slot": "chat1"}, {"X-Tenant-Id": f"t{i}"})["node"]
        for i in range(40)
    }
    assert homes == {"n1", "n2", "n3"}, "one slot id of many tenants spreads over the nodes"
