"""Prompt-processing progress events (``return_progress``) on SSE and both WebSockets."""

from __future__ import annotations

import itertools
from typing import Any

import httpx

from tests.conftest import ServerProc
from tests.orchestrator.client import sse_events, ws_binary, ws_v1

N_PROMPT = 2000
STEP = 256  # at most this many prompt tokens between two progress events


def long_prompt(salt: int) -> list[int]:
    """2000 valid token ids, different per ``salt`` so no slot's cache holds them."""
    return [100 + (i * 7919 + salt * 104729) % 40000 for i in range(N_PROMPT)]


def check_progress(events: list[dict[str, Any]], total: int) -> None:
    """Progress events come first, in order, at most STEP apart, and end at ``total``."""
    kinds = [e["type"] for e in events]
    assert "progress" in kinds, kinds[:5]
    first_token = kinds.index("token")
    assert all(k == "progress" for k in kinds[:first_token])
    assert "progress" not in kinds[first_token:]
    prog = [e["prompt_progress"] for e in events[:first_token]]
    done = [p["processed"] for p in prog]
    assert all(p["total"] == total and p["cache"] == 0 for p in prog)
    assert done[0] == 0 and done[-1] == total, done
    assert all(0 < b - a <= STEP for a, b in itertools.pairwise(done)), done
    times = [p["time_ms"] for p in prog]
    assert times == sorted(times)


def body(ids: list[int], slot: str) -> dict[str, Any]:
    return {"input_ids": ids, "max_new_tokens": 3, "temperature": 0, "return_progress": True, "conversation_id": slot}


def test_progress_on_sse(server: ServerProc) -> None:
    events = sse_events(server.url, body(long_prompt(1), "progress-sse") | {"output_attentions": True})
    check_progress(events, N_PROMPT)
    assert events[-1]["type"] == "done" and events[-1]["prompt_tokens"] == N_PROMPT


def test_progress_on_both_websockets(server: ServerProc) -> None:
    events = ws_v1(server.ws_url, [{"type": "generate", **body(long_prompt(2), "progress-ws0")}])
    check_progress(events, N_PROMPT)
    assert events[-1]["type"] == "done"

    # the binary WebSocket: progress comes as JSON text frames before the first token
    import json

    from websockets.sync.client import connect

    frames: list[dict[str, Any]] = []
    with connect(server.ws_url + "/api/extra/generate/stream/ws", max_size=None) as ws:
        ws.send(json.dumps(body(long_prompt(3), "progress-ws2")))
        for msg in ws:
            if isinstance(msg, str):
                frames.append(json.loads(msg))
                if frames[-1]["type"] in ("done", "error"):
                    break
    check_progress(frames, N_PROMPT)
    # without return_progress the binary socket sends no progress frames
    plain = ws_binary(server.ws_url, {"input_ids": long_prompt(3)[:50], "max_new_tokens": 2, "temperature": 0})
    assert plain.done is not None and len(plain.tokens) == 2


def test_no_progress_unless_asked(server: ServerProc) -> None:
    events = sse_events(server.url, {"input_ids": long_prompt(4)[:300], "max_new_tokens": 2, "output_attentions": True})
    assert [e["type"] for e in events] == ["token", "token", "done"]


def test_cached_prefix_counts_as_cache(server: ServerProc) -> None:
    ids = long_prompt(5)[:600]
    sse_events(server.url, {"input_ids": ids[:400], "max_new_tokens": 1, "conversation_id": "progress-cache"})
    events = sse_events(server.url, body(ids, "progress-cache") | {"output_attentions": True})
    prog = [e["prompt_progress"] for e in events if e["type"] == "progress"]
    assert prog[0]["cache"] >= 399 and prog[0]["processed"] == prog[0]["cache"]
    assert prog[-1]["processed"] == 600 and all(p["cache"] == prog[0]["cache"] for p in prog)


def test_progress_flag_is_validated(server: ServerProc) -> None:
    r = httpx.post(
        server.url + "/api/v1/generate",
        json={"input_ids": [1, 2, 3], "max_new_tokens": 1, "return_progress": "yes"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"
