"""Bounded memory per client: a WebSocket client that reads full attention far slower than the
engine makes it holds its own generation (flow control, ``contract/flow.py``: ``--stream-window``
and ``--stream-window-bytes``), not the server's memory, and slows no one else."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from websockets.sync.client import connect

from tests.conftest import ServerProc
from tests.orchestrator.client import N_HEAD, N_LAYER, tokenize, ws_binary

N_CONTEXT = 1990  # prompt tokens: each frame is float32[30, 9, ~2000], 2.2 MB
N_NEW = 56  # tokens the slow client reads: ~122 MB of frames, were they all buffered
MAX_GROWTH_MB = 60.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    """A server of its own.  Without ``--verify-cells`` (the session server's: it checks the KV
    cell mirror on every row, which at 2,000 tokens makes a token take seconds), and with one
    llama.cpp thread: two threads on two busy cores wait on each other at every graph node
    (measured here beside another test run: 2.7 s a token at 2,000 tokens, against 32 ms with
    one thread), so the pace this test compares would be the other load's, not the server's.
    ``--no-persist``: the write-behind save of a 2,000-token slot after a generation (a 46 MB
    state, compressed) lifts the server's RSS by ~150 MB for a moment, which is not the stream's."""
    args = [
        "--parallel",
        "2",
        "--ctx-size",
        "2048",
        "--threads",
        "1",
        "--no-persist",
        "--state-dir",
        str(tmp_path / "state"),
    ]
    srv = ServerProc(args, tmp_path).start()
    yield srv
    srv.stop()


def _body(ids: list[int], slot: str, n: int) -> dict[str, object]:
    return {
        "input_ids": ids,
        "max_new_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "id_slot": slot,
        "attention_format": "per_layer",
        "attention_dtype": "float32",
    }


def _rss_mb(pid: int) -> float:
    """Resident memory of the server: the orchestrator and its engine worker (its child), MB."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 1e6


def _timed(ws_url: str, body: dict[str, object]) -> tuple[int, float]:
    """Tokens a binary-WebSocket generation streamed, and its tokens per second (wall clock, at the client)."""
    t0 = time.monotonic()
    got = ws_binary(ws_url, body)
    assert got.done is not None, got.error
    return len(got.attention), len(got.attention) / (time.monotonic() - t0)


def test_slow_websocket_client_holds_its_generation_not_the_servers_memory(server: ServerProc) -> None:
    assert server.proc is not None
    pid = server.proc.pid
    text = "The history of the river valley, its towns, its farms and its people, told year by year. " * 120
    ids = tokenize(server.url, text)[:N_CONTEXT]
    assert len(ids) == N_CONTEXT

    # The engine's own pace at this context, read as fast as it comes (this also prefills slot
    # "slow-reader", so the slow run below reuses the prompt, and warms the server's buffers).
    warm = ws_binary(server.ws_url, _body(ids, "slow-reader", 8))
    assert warm.done is not None and len(warm.attention) == 8
    t0 = time.monotonic()
    ws_binary(server.ws_url, _body(ids, "slow-reader", 8))
    per_token_s = (time.monotonic() - t0) / 8  # prefix cached: almost all of it is decode + send
    delay = max(0.25, 10 * per_token_s)  # the slow client reads one token per ``delay`` seconds

    short = tokenize(server.url, "Tell me about rivers.")
    _timed(server.ws_url, _body(short, "fast-reader", N_NEW))  # prefills its slot
    _, alone_tps = _timed(server.ws_url, _body(short, "fast-reader", N_NEW))  # its pace with no one else

    baseline = _rss_mb(pid)
    peak = baseline
    frames: list[int] = []  # bytes of each binary frame the slow client got
    fast: dict[str, object] = {}

    def fast_stream() -> None:
        fast["tokens"], fast["tps"] = _timed(server.ws_url, _body(short, "fast-reader", N_NEW))
        fast["slow_frames_then"] = len(frames)

    other = threading.Thread(target=fast_stream)
    shapes: list[list[int]] = []
    done: dict[str, object] | None = None
    with connect(
        server.ws_url + "/api/extra/generate/stream/ws", max_size=None, max_queue=2, ping_interval=None, close_timeout=2
    ) as ws:
        ws.send(json.dumps(_body(ids, "slow-reader", N_NEW)))
        for msg in ws:
            if isinstance(msg, str):
                ev = json.loads(msg)
                assert ev["type"] in ("token", "done"), ev
                if ev["type"] == "done":
                    done = ev
                else:
                    shapes.append(ev["shape"])
                continue
            frames.append(len(msg))
            if len(frames) == 1:
                other.start()  # another slot streams while this client lags
            peak = max(peak, _rss_mb(pid))
            time.sleep(delay)
    other.join(60)
    growth = peak - baseline
    print(
        f"\nslow client: {len(frames)} frames of ~{frames[-1] / 1e6:.1f} MB, one per {delay:.2f} s "
        f"(engine: {per_token_s * 1000:.0f} ms a token); server RSS (orchestrator + worker) {baseline:.0f} MB "
        f"-> peak {peak:.0f} MB (+{growth:.1f} MB; {sum(frames) / 1e6:.0f} MB of frames sent); "
        f"the other stream: {fast.get('tps', 0):.1f} tokens/s beside it, {alone_tps:.1f} alone, "
        f"ended when the slow client had {fast.get('slow_frames_then')} frames"
    )
    assert done is not None and done["finish_reason"] == "length" and done["total_tokens"] == N_NEW
    assert len(frames) == len(shapes) == N_NEW  # every frame, none lost
    for k, (size, shape) in enumerate(zip(frames, shapes, strict=True)):
        assert shape == [N_LAYER, N_HEAD, N_CONTEXT + k] and size == 4 * N_LAYER * N_HEAD * (N_CONTEXT + k), (k, shape)
    assert growth < MAX_GROWTH_MB, f"server memory grew by {growth:.1f} MB"
    assert fast.get("tokens") == N_NEW
    slow_then = fast["slow_frames_then"]
    assert isinstance(slow_then, int) and slow_then < N_NEW // 2, "the other stream was slowed down"
