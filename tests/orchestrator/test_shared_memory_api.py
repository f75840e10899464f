"""What clients get when the worker's tensors come through the shared region (the default) equals, bit for
bit, what they get when they cross the worker's socket (``--stream-shm-bytes 0``): the JSON API, SSE and
the binary WebSocket, full per-layer attention and a reduced format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import ServerProc
from tests.orchestrator.client import decode_attention, post_json, sse_events, tokenize, ws_binary

TEXT = "The lighthouse keeper counted the ships that passed the rocks each night, and wrote them down. " * 4


def _body(ids: list[int], slot: str, **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "id_slot": slot, **extra}


def _served(tmp_path: Path, args: list[str]) -> dict[str, Any]:
    srv = ServerProc(["--parallel", "4", "--ctx-size", "512", "--no-persist", *args], tmp_path).start()
    try:
        ids = tokenize(srv.url, TEXT)
        full = {"return_attention": True, "attention_format": "per_layer", "attention_dtype": "float32"}
        js = post_json(srv.url, "/api/v1/generate", _body(ids, "a", **full))
        topk = post_json(
            srv.url,
            "/api/v1/generate",
            _body(ids, "b", return_attention=True, attention_format="topk", attention_top_k=4),
        )
        sse = sse_events(srv.url, _body(ids, "c", output_attentions=True, attention_dtype="float16"))
        ws = ws_binary(srv.ws_url, _body(ids, "d", **full))
        assert ws.done is not None, ws.error
        return {
            "json": [decode_attention(a["attention"]).tobytes() for a in js["attention_data"]],
            "topk": [(a["attention"]["data"], a["attention"]["positions"]) for a in topk["attention_data"]],
            "sse": [decode_attention(e["attention"]).tobytes() for e in sse if e.get("type") == "token"],
            "ws": [a.tobytes() for a in ws.attention],
            "tokens": [t["token_id"] for t in js["generated_tokens"]],
        }
    finally:
        srv.stop()


def test_every_transport_gets_the_same_bytes_through_shared_memory(tmp_path: Path) -> None:
    shared = _served(tmp_path, ["--stream-shm-bytes", str(64 << 20)])
    inline = _served(tmp_path, ["--stream-shm-bytes", "0"])
    for kind in ("json", "topk", "sse", "ws"):
        assert len(shared[kind]) == 6, kind
    assert shared == inline
    first = np.frombuffer(shared["ws"][0], np.float32).reshape(30, 9, -1)
    np.testing.assert_allclose(first.sum(axis=-1), 1.0, atol=1e-3)  # real rows, not zeros
