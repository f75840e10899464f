"""Bounded memory per client, the other direction: a WebSocket client that sends far more than the
server serves during one generation is held back by TCP (``Inbox`` in ``orchestrator/api/native/ws.py``
stops reading, and uvicorn's ``websockets-sansio`` protocol holds one message at most), so the
server's memory stays flat, and every message is still served, in order, after the generation."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from websockets.sync.client import connect

from tests.conftest import ServerProc
from tests.orchestrator.client import tokenize

MESSAGE = 1 << 20  # bytes of each flooding message (not JSON: each is answered INVALID_REQUEST)
N_FLOOD = 160  # 160 MiB the client tries to push during one generation
MAX_GROWTH_MB = 40.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    """One slot, one llama.cpp thread (the test_slow_client.py reasons), and a 2 MiB message limit:
    the inbox then keeps under 4 MiB of waiting messages."""
    args = ["--parallel", "1", "--ctx-size", "1024", "--threads", "1", "--no-persist", "--max-body", str(2 << 20)]
    srv = ServerProc(args, tmp_path).start()
    yield srv
    srv.stop()


def _rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 1e6


def test_a_flooding_client_is_held_back_not_buffered(server: ServerProc) -> None:
    assert server.proc is not None
    pid = server.proc.pid
    ids = tokenize(server.url, "Once upon a time, in a quiet village by the sea,")
    body = {"type": "generate", "input_ids": ids, "max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
    baseline = _rss_mb(pid)
    peak = baseline
    sent = 0
    sent_at_done: int | None = None
    events: list[dict[str, object]] = []
    with connect(server.ws_url + "/api/v1/generate/stream", max_size=None, ping_interval=None, close_timeout=2) as ws:
        ws.send(json.dumps(body))
        first = json.loads(ws.recv(timeout=120))  # the generation runs
        assert first["type"] in ("token", "queued"), first
        events.append(first)

        def flood() -> None:
            nonlocal sent
            for k in range(N_FLOOD):
                ws.send(bytes([k % 256]) * MESSAGE)  # blocks while the server does not read
                sent += 1

        stop = threading.Event()

        def sample() -> None:  # the server's memory, every 20 ms, beside the reading
            nonlocal peak
            while not stop.wait(0.02):
                peak = max(peak, _rss_mb(pid))

        sender, sampler = threading.Thread(target=flood), threading.Thread(target=sample)
        sampler.start()
        sender.start()
        errors = 0
        while errors < N_FLOOD:
            ev = json.loads(ws.recv(timeout=120))
            events.append(ev)
            if ev["type"] == "done":
                sent_at_done = sent
            elif ev["type"] == "error":
                assert ev["error_code"] == "INVALID_REQUEST", ev
                errors += 1
        sender.join(30)
        stop.set()
        sampler.join()
    growth = peak - baseline
    tokens = sum(1 for e in events if e["type"] == "token")
    print(
        f"\nflood: {N_FLOOD} messages of {MESSAGE >> 20} MiB sent during a {tokens}-token generation; "
        f"{sent_at_done} had gone when it ended; server RSS (orchestrator + worker) {baseline:.0f} MB -> "
        f"peak {peak:.0f} MB (+{growth:.1f} MB)"
    )
    assert tokens == 300 and sent_at_done is not None
    assert errors == N_FLOOD and sent == N_FLOOD  # every message served after the generation
    # what went before the end: the inbox's 2 MiB or so, the message uvicorn holds, and the kernel's
    # socket buffers (loopback autotunes them up to net.ipv4.tcp_rmem's and tcp_wmem's maxima: 24 MiB here)
    assert sent_at_done < N_FLOOD // 2, "the server read the flood while generating"
    assert growth < MAX_GROWTH_MB, f"server memory grew by {growth:.1f} MB"
