"""Reduced attention formats over JSON, SSE and the binary WebSocket (docs/api.md, "Attention formats"),
checked against the full per-layer rows of the same greedy generation on a real server and worker, with a
chat of several messages longer than one batch (n_batch 512)."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from tests.conftest import ServerProc
from tests.orchestrator.client import decode_attention, sse_events, tokenize

N_NEW = 4
ATOL = 2e-5  # float32 rows of two slots computed alike; the worker's numpy mean vs the graph's


@pytest.fixture(scope="module")
def ids(server: ServerProc) -> list[int]:
    turns = "".join(
        f"<|im_start|>user\nBox {i} holds {' and '.join(f'{c} marble {j}' for j, c in enumerate(['red', 'blue'] * 9))}."
        f"<|im_end|>\n<|im_start|>assistant\nNoted box {i}.<|im_end|>\n"
        for i in range(5)
    )
    out = tokenize(server.url, turns + "<|im_start|>user\nWhich box?<|im_end|>\n<|im_start|>assistant\n")
    assert len(out) > 512
    return out


def body(ids: list[int], slot: str, **kw: object) -> dict[str, object]:
    return {"input_ids": ids, "max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "id_slot": slot, **kw}


@pytest.fixture(scope="module")
def ref(server: ServerProc, ids: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """The full rows ``float32[30, 9, n]`` of each generated token, and the tokens."""
    r = httpx.post(server.url + "/api/v1/generate", json=body(ids, "red-ref", return_attention=True), timeout=300)
    assert r.status_code == 200, r.text
    js = r.json()
    return [t["token_id"] for t in js["generated_tokens"]], [
        decode_attention(e["attention"]) for e in js["attention_data"]
    ]


def comparable(tokens: list[int], ref_tokens: list[int]) -> int:
    """Rows computed from the same context: up to and including the first token where greedy parts (a near tie
    may flip between two slots)."""
    for k, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)):
        if a != b:
            return k + 1
    return len(tokens)


def check_topk(w: np.ndarray, pos: np.ndarray, full: np.ndarray, k: int) -> None:
    """``w``/``pos`` are ``full``'s ``k`` largest weights per layer and head, best first, and their positions."""
    assert w.shape == pos.shape == (*full.shape[:2], k)
    np.testing.assert_allclose(w, -np.sort(-full, axis=-1)[..., :k], atol=ATOL)
    np.testing.assert_allclose(np.take_along_axis(full, pos.astype(np.int64), axis=-1), w, atol=ATOL)
    assert np.all(w[..., :-1] >= w[..., 1:])


def b64(data: str, dtype: type) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype=dtype)


def test_json_topk_with_heads_layers_and_sink(server: ServerProc, ids: list[int], ref) -> None:  # type: ignore[no-untyped-def]
    req = body(ids, "red-json", return_attention=True, attention_format="topk", attention_top_k=5,
               attention_layers=[29, 0], attention_heads=[8, 0, 4], attention_sink=4)  # fmt: skip
    r = httpx.post(server.url + "/api/v1/generate", json=req, timeout=300)
    assert r.status_code == 200, r.text
    js = r.json()
    tokens = [t["token_id"] for t in js["generated_tokens"]]
    for k in range(comparable(tokens, ref[0])):
        att = js["attention_data"][k]["attention"]
        assert att["format"] == "topk" and att["shape"] == [2, 3, 5] and att["context_length"] == len(ids) + k
        full = ref[1][k][[29, 0]][:, [8, 0, 4]]
        check_topk(decode_attention(att), b64(att["positions"], np.int32).reshape(2, 3, 5), full, 5)
        assert att["sink"] == pytest.approx(float(full.mean(axis=(0, 1))[:4].sum()), abs=ATOL)


def test_sse_spans_default_to_the_chat_messages(server: ServerProc, ids: list[int], ref) -> None:  # type: ignore[no-untyped-def]
    eot = httpx.get(server.url + "/api/v1/model", timeout=30).json()["eot_token_id"]
    ends = [i + 1 for i, t in enumerate(ids) if t == eot]
    spans = list(zip([0, *ends], [*ends, len(ids)], strict=True))
    spans = [(a, b) for a, b in spans if a < b]
    assert len(spans) == 12  # eleven messages and the open assistant turn
    req = body(ids, "red-sse", output_attentions=True, attention_format="spans", attention_dtype="float16")
    events = [e for e in sse_events(server.url, req, timeout=300) if e["type"] == "token"]
    tokens = [e["token"]["token_id"] for e in events]
    for k in range(comparable(tokens, ref[0])):
        att = events[k]["attention"]
        assert att["format"] == "spans" and att["shape"] == [len(spans)] and att["dtype"] == "float16"
        assert att["context_length"] == len(ids) + k and "positions" not in att and "sink" not in att
        mean = ref[1][k].mean(axis=(0, 1))
        want = [mean[a:b].sum() for a, b in spans]
        np.testing.assert_allclose(decode_attention(att).astype(np.float32), want, atol=2e-3)  # float16


def test_binary_ws_topk_sends_positions_in_a_second_frame(server: ServerProc, ids: list[int], ref) -> None:  # type: ignore[no-untyped-def]
    req = body(ids, "red-ws", attention_format="topk", attention_top_k=3, attention_dtype="float16",
               attention_spans=None, attention_sink=1)  # fmt: skip
    frames: list[str | bytes] = []
    with connect(server.ws_url + "/api/extra/generate/stream/ws", max_size=None, close_timeout=2) as ws:
        ws.send(json.dumps(req))
        frames = list(ws)
    texts = [json.loads(f) for f in frames if isinstance(f, str)]
    assert texts[-1]["type"] == "done"
    tokens = [t["token_id"] for t in texts if t["type"] == "token"]
    # per token: its text frame, the weights' frame, the positions' frame
    assert len(frames) == 3 * N_NEW + 1
    for k in range(comparable(tokens, ref[0])):
        head, wf, pf = frames[3 * k : 3 * k + 3]
        assert isinstance(head, str) and isinstance(wf, bytes) and isinstance(pf, bytes)
        meta = json.loads(head)
        assert meta["shape"] == [30, 9, 3] and meta["positions"] is True and meta["context_length"] == len(ids) + k
        w = np.frombuffer(wf, dtype=np.float16).reshape(30, 9, 3)
        pos = np.frombuffer(pf, dtype=np.int32).reshape(30, 9, 3)
        full = ref[1][k]
        np.testing.assert_allclose(w.astype(np.float32), -np.sort(-full, axis=-1)[..., :3], atol=1e-3)
        np.testing.assert_allclose(np.take_along_axis(full, pos.astype(np.int64), axis=-1), w, atol=1e-3)
        assert meta["sink"] == pytest.approx(float(full.mean(axis=(0, 1))[0]), abs=ATOL)


BAD: list[dict[str, Any]] = [
    {"attention_format": "topk"},
    {"attention_format": "topk", "attention_top_k": 0},
    {"attention_format": "topk", "attention_top_k": -3},
    {"attention_format": "topk", "attention_top_k": 100_000},
    {"attention_format": "aggregated", "attention_top_k": 4},
    {"attention_format": "per_layer", "attention_spans": [[0, 2]]},
    {"attention_format": "spans", "attention_spans": []},
    {"attention_format": "spans", "attention_spans": [[0, 4], [3, 6]]},
    {"attention_format": "spans", "attention_spans": [[4, 6], [0, 2]]},
    {"attention_format": "spans", "attention_spans": [[2, 2]]},
    {"attention_format": "spans", "attention_spans": [[-1, 2]]},
    {"attention_format": "spans", "attention_spans": [[0, 99]]},
    {"attention_format": "spans", "attention_spans": [[0, 1, 2]]},
    {"attention_heads": [9]},
    {"attention_heads": [-1]},
    {"attention_heads": [1, 1]},
    {"attention_heads": []},
    {"attention_sink": -1},
    {"attention_sink": 100_000},
    {"attention_format": "median"},
]


def test_bad_reductions_are_400_and_change_nothing(server: ServerProc) -> None:
    base = tokenize(server.url, "<|im_start|>user\nHello there, how are you?<|im_end|>\n")
    ok = httpx.post(server.url + "/api/v1/generate", json=body(base, "red-bad", max_new_tokens=2), timeout=120)
    assert ok.status_code == 200
    before = httpx.get(server.url + "/v1/slots/red-bad/info", timeout=30).json()
    other = base[:-3]  # a request that would truncate the slot's cache if it ran
    for bad in BAD:
        r = httpx.post(
            server.url + "/api/v1/generate", json=body(other, "red-bad", return_attention=True, **bad), timeout=120
        )
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error_code"] == "INVALID_REQUEST", (bad, r.text)
    with httpx.stream("POST", server.url + "/api/extra/generate/stream", timeout=120,
                      json=body(other, "red-bad", output_attentions=True, attention_heads=[12])) as r:  # fmt: skip
        assert r.status_code == 400 and json.loads(r.read())["error_code"] == "INVALID_REQUEST"
    with connect(server.ws_url + "/api/extra/generate/stream/ws", max_size=None, close_timeout=2) as ws:
        ws.send(json.dumps(body(other, "red-bad", attention_format="topk", attention_top_k=0)))
        err = json.loads(ws.recv(timeout=60))
        assert err["type"] == "error" and err["error_code"] == "INVALID_REQUEST"
    assert httpx.get(server.url + "/v1/slots/red-bad/info", timeout=30).json() == before
    r = httpx.post(server.url + "/api/v1/generate", json=body(other, "red-new", **BAD[0], return_attention=True))
    assert r.status_code == 400
    assert httpx.get(server.url + "/v1/slots/red-new/info", timeout=30).status_code == 404  # no slot made
