"""Tenants on a real server (the real engine on the default model): keys from ``--api-keys``,
reloaded on SIGHUP; 401 for a wrong or missing key; the gateway's tenant header only with its
secret; admin endpoints refuse a user key; 429 with ``Retry-After`` past ``--tenant-generations``;
and four clients that stop reading their SSE streams (sockets open, ``--parallel 4``) hold the
engine only until ``--stall-timeout``: a fifth client's request is then answered."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import CHAT, ROOT, ServerProc

STALL_S = 3.0
KEYS = "# two tenants, one admin\nkey-a tenant-a\nsha256:{b} tenant-b\nkey-ops ops admin\n"
KEY_C = "# tenants of the stalled readers\nkey-s{i} reader-{i}\n"


def keys_text(extra: str = "") -> str:
    return KEYS.format(b=hashlib.sha256(b"key-b").hexdigest()) + extra


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(keys_text("".join(KEY_C.format(i=i) for i in range(5))))
    return path


@pytest.fixture
def tenant_server(start_server: Callable[..., ServerProc], keys_file: Path, tmp_path: Path) -> ServerProc:
    return start_server(
        *("--parallel", "4", "--ctx-size", "2048", "--api-keys", str(keys_file)),
        *("--tenant-header", "X-Tenant-Id", "--gateway-secret", "gw-secret"),
        *("--tenant-generations", "1", "--stall-timeout", str(STALL_S)),
        *("--state-dir", str(tmp_path / "state")),
    )


def test_a_bad_keys_file_stops_the_start_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "keys.txt"
    bad.write_text("good-key t\nsecret-key t superuser\n")
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--api-keys", str(bad), "--state-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"{bad}:2: the role is 'user' or 'admin'" in out.stderr and "secret-key" not in out.stderr


def test_keys_tenants_admin_and_the_gateway_header(tenant_server: ServerProc, keys_file: Path) -> None:
    srv = tenant_server
    tok = {"content": "hello"}
    for headers in ({}, bearer("wrong"), bearer("key-b-typo"), {"X-Api-Key": ""}):
        r = httpx.post(srv.url + "/tokenize", json=tok, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED", (headers, r.text)
    for headers in (bearer("key-a"), bearer("key-b"), {"X-Api-Key": "key-ops"}):
        assert httpx.post(srv.url + "/tokenize", json=tok, headers=headers, timeout=30).status_code == 200
    # the gateway's header: only with its secret
    r = httpx.post(srv.url + "/tokenize", json=tok, headers={"X-Tenant-Id": "acme"}, timeout=30)
    assert r.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED"
    r = httpx.post(
        srv.url + "/tokenize", json=tok, headers={"X-Tenant-Id": "acme", "X-Gateway-Secret": "no"}, timeout=30
    )
    assert r.status_code == 401
    gw = {"X-Tenant-Id": "acme", "X-Gateway-Secret": "gw-secret"}
    assert httpx.post(srv.url + "/tokenize", json=tok, headers=gw, timeout=30).status_code == 200
    # admin endpoints: a user key (and the gateway's user) is refused, the admin key passes
    for headers in (bearer("key-a"), gw):
        for path in ("/admin", "/admin/api/slots"):
            r = httpx.get(srv.url + path, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED", (path, r.text)
    assert httpx.get(srv.url + "/admin/api/slots", headers=bearer("key-ops"), timeout=30).status_code == 200
    # SIGHUP re-reads the file: a new key works, a removed one is refused
    keys_file.write_text(keys_text().replace("key-a tenant-a", "key-a2 tenant-a"))
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while httpx.post(srv.url + "/tokenize", json=tok, headers=bearer("key-a2"), timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the keys file was not reloaded"
        time.sleep(0.2)
    assert httpx.post(srv.url + "/tokenize", json=tok, headers=bearer("key-a"), timeout=30).status_code == 401
    # a broken file on SIGHUP: the keys in use stay
    keys_file.write_text("broken line with too many words\n")
    srv.proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert httpx.post(srv.url + "/tokenize", json=tok, headers=bearer("key-a2"), timeout=30).status_code == 200
    assert "keys file not reloaded" in srv.log_path.read_text()


def test_a_tenant_over_its_generations_gets_429_with_retry_after(tenant_server: ServerProc) -> None:
    srv = tenant_server
    long_body = {"prompt": CHAT.format("Count to a thousand."), "max_new_tokens": 400, "ignore_eos": True}
    started = threading.Event()
    out: dict[str, object] = {}

    def hold() -> None:
        with httpx.stream(
            "POST", srv.url + "/api/extra/generate/stream", json=long_body, headers=bearer("key-a"), timeout=300
        ) as r:
            out["status"] = r.status_code
            for _ in r.iter_lines():
                started.set()
                if out.get("stop"):
                    return

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert started.wait(120), out
    body = {"prompt": CHAT.format("hi"), "max_new_tokens": 2, "conversation_id": "second"}
    r = httpx.post(srv.url + "/api/v1/generate", json=body, headers=bearer("key-a"), timeout=60)
    assert r.status_code == 429 and r.json()["error_code"] == "RATE_LIMITED", r.text
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(srv.url + "/api/v1/generate", json=body, headers=bearer("key-b"), timeout=120)
    assert r.status_code == 200, r.text  # another tenant is not limited by tenant-a's generations
    out["stop"] = True
    t.join(60)
    for who in ({}, bearer("key-a")):  # every tenant's figures: the operator's (admin) only
        r = httpx.get(srv.url + "/metrics", headers=who, timeout=30)
        assert r.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED" and "tenant-b" not in r.text
    metrics = httpx.get(srv.url + "/metrics", headers=bearer("key-ops"), timeout=30).text
    assert 'slotserve_tenant_refused_total{limit="generations",tenant="tenant-a"} 1.0' in metrics
    assert 'slotserve_tenant_generations_total{tenant="tenant-b"}' in metrics


class StalledReader:
    """An SSE client that reads the response head and its first event, then stops reading, its
    socket open and its receive buffer small (the server's writes back up at once)."""

    def __init__(self, srv: ServerProc, key: str, body: dict[str, object]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", srv.port))
        payload = json.dumps(body).encode()
        head = (
            f"POST /api/extra/generate/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + payload)
        got = b""
        self.sock.settimeout(300)
        while b"data:" not in got:
            chunk = self.sock.recv(1024)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:200]

    def close(self) -> None:
        self.sock.close()


def test_four_stalled_readers_do_not_hold_the_engine(tenant_server: ServerProc) -> None:
    srv = tenant_server
    text = "The long history of the river valley, its towns and its people, year by year. " * 12
    r = httpx.post(srv.url + "/api/v1/tokenize", json={"text": text}, headers=bearer("key-s4"), timeout=30)
    ids = r.json()["token_ids"]
    fifth = {"input_ids": ids[:40], "max_new_tokens": 4, "temperature": 0, "conversation_id": "fifth"}
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/api/v1/generate", json=fifth, headers=bearer("key-s4"), timeout=300)
    alone_s = time.monotonic() - t0
    assert r.status_code == 200, r.text
    readers = []
    try:
        for i in range(4):  # per-layer attention: each event is ~150 KB, so the socket fills in a few tokens
            body = {
                "input_ids": ids,
                "max_new_tokens": 1500,
                "ignore_eos": True,
                "output_attentions": True,
                "attention_format": "per_layer",
                "conversation_id": f"stalled-{i}",
            }
            readers.append(StalledReader(srv, f"key-s{i}", body))
        t0 = time.monotonic()
        r = httpx.post(
            srv.url + "/api/v1/generate", json={**fifth, "max_new_tokens": 8}, headers=bearer("key-s4"), timeout=600
        )
        waited_s = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["results"][0]["text"] is not None, r.text
        metrics = httpx.get(srv.url + "/metrics", headers=bearer("key-ops"), timeout=30).text
        stalled = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("slotserve_stalled_generations_total{")
        )
        assert stalled >= 1, "a stalled reader was parked to serve the fifth request"
        print(
            f"\nfifth request alone: {alone_s:.2f} s; beside four stalled readers (--stall-timeout {STALL_S:g}):"
            f" {waited_s:.2f} s; stalled generations parked: {stalled:g}"
        )
    finally:
        for reader in readers:
            reader.close()
    # the stalled clients are gone: their requests end, their slots are free for their next turns
    for i in range(4):
        body = {"input_ids": ids[:20], "max_new_tokens": 2, "conversation_id": f"stalled-{i}", "wait": True}
        r = httpx.post(srv.url + "/api/v1/generate", json=body, headers=bearer(f"key-s{i}"), timeout=300)
        assert r.status_code == 200, r.text
