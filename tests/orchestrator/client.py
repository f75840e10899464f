"""Minimal clients for end-to-end tests, reading the wire formats the way real clients do."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from websockets.sync.client import connect

N_LAYER, N_HEAD = 30, 9


def decode_attention(att: dict[str, Any]) -> np.ndarray:
    """The JSON/SSE APIs' base64 attention to an array of its ``shape``."""
    dt = np.float16 if att["dtype"] == "float16" else np.float32
    return np.frombuffer(base64.b64decode(att["data"]), dtype=dt).reshape(att["shape"])


def sse_events(
    base: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 120
) -> list[dict[str, Any]]:
    """POST the SSE endpoint and parse ``event: message`` / ``data:`` frames (split on blank lines)."""
    return list(iter_sse_events(base, body, headers, timeout))


def iter_sse_events(
    base: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 120
) -> Iterator[dict[str, Any]]:
    """:func:`sse_events`, each event yielded as soon as it arrives (``timeout``: seconds between two reads)."""
    with httpx.stream("POST", base + "/api/extra/generate/stream", json=body, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            while "\n\n" in buf:
                frame, buf = buf.split("\n\n", 1)
                lines = frame.split("\n")
                assert lines[0] == "event: message", frame[:80]
                data = "".join(line[6:] for line in lines if line.startswith("data: "))
                yield json.loads(data)


@dataclass
class BinaryStream:
    """What the binary WebSocket endpoint sent."""

    tokens: list[dict[str, Any]] = field(default_factory=list)
    attention: list[np.ndarray] = field(default_factory=list)
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    close_code: int | None = None


def ws_binary(ws_base: str, config: dict[str, Any] | str, ctx_len: int | None = None) -> BinaryStream:
    """Run one generation on ``/api/extra/generate/stream/ws`` like a browser client of the binary WebSocket."""
    res = BinaryStream()
    with connect(ws_base + "/api/extra/generate/stream/ws", max_size=None, close_timeout=2) as ws:
        ws.send(config if isinstance(config, str) else json.dumps(config))
        pending: dict[str, Any] | None = None
        for msg in ws:
            if isinstance(msg, str):
                data = json.loads(msg)
                if data["type"] == "token":
                    assert pending is None or "shape" not in pending, "a token frame without its binary frame"
                    pending = data
                    res.tokens.append(data)
                elif data["type"] == "done":
                    res.done = data
                elif data["type"] == "error":
                    res.error = data
            else:
                assert pending is not None, "binary frame without a token frame"
                arr = np.frombuffer(msg, dtype=np.float32)
                n_ctx = arr.size // (N_LAYER * N_HEAD)
                res.attention.append(arr.reshape(N_LAYER, N_HEAD, n_ctx))
                pending = None
        res.close_code = ws.close_code
    return res


def ws_v1(ws_base: str, messages: list[dict[str, Any] | str], until_done: int = 1) -> list[dict[str, Any]]:
    """Send the JSON WebSocket's ``generate`` messages; collect events until ``until_done`` done/error events."""
    events: list[dict[str, Any]] = []
    with connect(ws_base + "/api/v1/generate/stream", max_size=None, close_timeout=2) as ws:
        for m in messages:
            ws.send(m if isinstance(m, str) else json.dumps(m))
        finished = 0
        while finished < until_done:
            ev = json.loads(ws.recv(timeout=120))
            events.append(ev)
            if ev["type"] in ("done", "error"):
                finished += 1
    return events


# Two slots holding the same tokens on different KV cells give logprobs up to 0.28 nat
# apart on SmolLM2 Q4_1 (measured: the same 12-token greedy turn on two slots, and with
# a preview batched beside it; the Q8 activation rounding amplifies the cell-order
# difference through 30 layers).  A flip needs both sides to move, so twice that.
GREEDY_NOISE_NATS = 0.6


def post_json(base: str, path: str, body: object, status: int = 200, timeout: float = 300) -> Any:
    """POST ``body`` as JSON to ``base + path``; asserts the ``status`` and returns the decoded answer."""
    r = httpx.post(base + path, json=body, timeout=timeout)
    assert r.status_code == status, r.text
    return r.json()


def tokenize(base: str, text: str) -> list[int]:
    r = httpx.post(base + "/api/v1/tokenize", json={"text": text}, timeout=30)
    r.raise_for_status()
    return r.json()["token_ids"]


def assert_same_greedy(a: dict[str, Any], b: dict[str, Any], margin: float = GREEDY_NOISE_NATS) -> int:
    """Two greedy generations (``/api/v1/generate`` bodies with ``n_probs`` of a few) agree.

    They must be identical, except that they may part on a near-tie: where ``b``'s token
    is among ``a``'s top tokens, within ``margin`` nats of ``a``'s best.  KV cells laid
    out differently (another slot, another batch composition) round differently (see
    tests/engine/enginekit.py), so a near-tie may flip.  Where both carry logprobs, the
    tokens they agree on must have logprobs within ``margin`` of each other.  Everything
    after a flip is not compared.  Returns how many leading tokens were computed from
    the same context (their attention rows are comparable).
    """
    ta, tb = a["generated_tokens"], b["generated_tokens"]
    for k, (x, y) in enumerate(zip(ta, tb, strict=False)):
        if x["token_id"] == y["token_id"]:
            if "logprob" in x and "logprob" in y:
                assert abs(x["logprob"] - y["logprob"]) < margin, (
                    f"token {k}: logprobs {x['logprob']} vs {y['logprob']}"
                )
            continue
        top = {t["token_id"]: t["logprob"] for t in x["top_logprobs"]}
        best = max(top.values())
        assert y["token_id"] in top and best - top[y["token_id"]] < margin, (
            f"token {k}: {x['token_id']} vs {y['token_id']}; top logprobs of the first: {top}"
        )
        return k + 1
    assert len(ta) == len(tb)
    return len(ta)
