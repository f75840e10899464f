"""Header size and header/body read timeouts (orchestrator/web/read_limits.py; issue 23, item 5).

A slow client (slowloris) and a huge head are refused with a JSON error and a closed
connection; requests sent normally, one after another on one connection, pass.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from orchestrator.web.read_limits import ReadLimits, limited_protocol
from tests.conftest import ServerProc
from tests.redis_server import free_port
from tests.waiting import DEADLINE_S, wait_until

LIMITS = ReadLimits(max_header_bytes=4096, header_timeout_s=0.5, body_timeout_s=0.5)
seen: list[dict[str, Any]] = []  # what the application was given, per request


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers the length of the body it read, and records whether its client left."""
    if scope["type"] != "http":
        return
    body, gone = b"", False
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            gone = True
            break
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    seen.append({"path": scope["path"], "body": len(body), "gone": gone})
    if not gone:
        out = json.dumps({"body": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(echo, host="127.0.0.1", port=port, http=limited_protocol(LIMITS), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "uvicorn listens")
    yield port
    server.should_exit = True
    thread.join(DEADLINE_S)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(DEADLINE_S)  # only a bound on a hang: the server answers, then closes
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def refusal(raw: bytes) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of the one response in ``raw``."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def test_headers_that_never_finish_get_408_and_the_connection_closes(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        status, body = refusal(read_to_close(sock))
    assert status == 408 and body["error_code"] == "REQUEST_TIMEOUT", body
    assert not any(s["path"] == "/slow" for s in seen), "the application never saw the request"


def test_a_head_trickled_a_byte_at_a_time_is_cut_off(port: int) -> None:
    """The header timeout bounds the whole head, not the pause between two bytes."""
    request = b"GET /trickle HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000 + b"\r\n\r\n"
    with connect(port) as sock:
        closed = threading.Event()

        def trickle() -> None:
            for byte in request:
                if closed.is_set():
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.01)  # the client's pace (a slow client), not a wait for the server

        sender = threading.Thread(target=trickle)
        sender.start()
        raw = read_to_close(sock)
        closed.set()
        sender.join()
    status, body = refusal(raw)
    assert status == 408 and body["error_code"] == "REQUEST_TIMEOUT", body


def test_a_header_over_the_limit_gets_431(port: int) -> None:
    for size in (8 << 10, 200 << 10):  # one read, and many
        with connect(port) as sock:
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * size + b"\r\n\r\n")
            status, body = refusal(read_to_close(sock))
        assert status == 431 and body["error_code"] == "PAYLOAD_TOO_LARGE", body
    assert not any(s["path"] == "/big" for s in seen)


def test_a_body_that_stops_coming_gets_408_and_the_application_sees_the_client_gone(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST /stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        status, body = refusal(read_to_close(sock))
    assert status == 408 and body["error_code"] == "REQUEST_TIMEOUT", body
    assert wait_until(lambda: [s for s in seen if s["path"] == "/stalled"], "the application ends") == [
        {"path": "/stalled", "body": 3, "gone": True}
    ]


def test_requests_sent_normally_pass_one_after_another_on_one_connection(port: int) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:
        for n in (0, 10, 1 << 20):
            r = client.post("/fine", content=b"x" * n, headers={"X-Pad": "p" * 2000})
            assert r.status_code == 200 and r.json() == {"body": n}
        # past the header timeout since the connection opened: each request has its own
        time.sleep(LIMITS.header_timeout_s)  # the connection idles (uvicorn's keep-alive is 5 s)
        assert client.get("/fine").json() == {"body": 0}


def test_the_server_refuses_a_200_kb_header_and_goes_on(server: ServerProc) -> None:
    r = httpx.get(server.url + "/health", headers={"X-Big": "b" * (200 << 10)}, timeout=DEADLINE_S)
    assert r.status_code == 431 and r.json()["error_code"] == "PAYLOAD_TOO_LARGE", r.text
    assert httpx.get(server.url + "/health", timeout=DEADLINE_S).status_code == 200


def test_the_server_closes_a_connection_whose_headers_never_finish(start_server: Any) -> None:
    srv = start_server("--header-timeout", "1", "--no-persist", "--ctx-size", "256", "--parallel", "1")
    with connect(srv.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        status, body = refusal(read_to_close(sock))
    assert status == 408 and body["error_code"] == "REQUEST_TIMEOUT", body
