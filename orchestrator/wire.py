"""Wire encoders: one function per event shape the clients read.

Shapes are docs/api.md's: the JSON WebSocket's ``token``/``done``/``error`` events
(base64 attention, ``logprob``, ``top_logprobs``), the SSE stream (KoboldCpp's
``{"token", "finish_reason"}`` events, and the attention events ``{"type":"token",
"token":{...}, "attention":{...}}``), the binary WebSocket (a JSON text frame per token,
then the raw float32 attention frame).  Attention bytes are the worker's bytes, untouched.
"""

from __future__ import annotations

import base64
from typing import Any

from engine.protocol import Progress
from orchestrator.generation.events import DoneOut, TokenOut

KOBOLD_FINISH = {"length": "length", "stop_token": "stop", "stop_string": "stop", "cancelled": "abort"}


def slot_id_out(slot_id: str) -> int | str:
    """llama-server reports numeric slot ids as integers."""
    return int(slot_id) if slot_id.isdigit() and len(slot_id) < 10 else slot_id


def token_text_fields(t: TokenOut) -> dict[str, Any]:
    """``{"token_id", "text"}`` plus ``bytes`` when the piece alone is not valid UTF-8."""
    out: dict[str, Any] = {"token_id": t.token_id, "text": t.text}
    try:
        t.piece.decode("utf-8")
    except UnicodeDecodeError:
        out["bytes"] = list(t.piece)
    return out


def attention_json(t: TokenOut, fmt: str, dtype: str) -> dict[str, Any] | None:
    """The attention object of the JSON and SSE APIs (docs/api.md, "Attention"): format, shape,
    context_length, base64 data."""
    if t.attention is None:
        return None
    return {
        "format": fmt,
        "shape": t.attention_shape,
        "context_length": t.attention_shape[-1],
        "encoding": "base64",
        "dtype": dtype,
        "data": base64.b64encode(t.attention).decode("ascii"),
    }


def hidden_json(t: TokenOut) -> dict[str, Any] | None:
    """``{"shape": [n_embd], "encoding": "base64", "dtype": "float32", "data"}`` (Halo Weave)."""
    if t.hidden is None:
        return None
    return {
        "shape": [len(t.hidden) // 4],
        "encoding": "base64",
        "dtype": "float32",
        "data": base64.b64encode(t.hidden).decode("ascii"),
    }


def top_logprobs(t: TokenOut, pieces: list[bytes] | None = None) -> list[dict[str, Any]]:
    """``[{"token_id", "logprob"(, "text")}]`` best first."""
    out = []
    for tok, lp in t.top:
        item: dict[str, Any] = {"token_id": tok, "logprob": lp}
        if pieces is not None:
            item["text"] = pieces[tok].decode("utf-8", "replace")
        out.append(item)
    return out


def v1_token_event(t: TokenOut, request_id: str | None, fmt: str, dtype: str, pieces: list[bytes]) -> dict[str, Any]:
    """The JSON WebSocket's ``token`` event (docs/api.md, "WS /api/v1/generate/stream")."""
    token = token_text_fields(t)
    token["logprob"] = t.logprob
    token["top_logprobs"] = top_logprobs(t, pieces)
    ev: dict[str, Any] = {"type": "token", "request_id": request_id, "index": t.index, "token": token}
    att = attention_json(t, fmt, dtype)
    if att is not None:
        ev["attention"] = att
    hid = hidden_json(t)
    if hid is not None:
        ev["hidden_state"] = hid
    return ev


def done_event(d: DoneOut, request_id: str | None) -> dict[str, Any]:
    """The ``done`` event (docs/api.md, "``done`` fields")."""
    ev: dict[str, Any] = {
        "type": "done",
        "request_id": request_id,
        "finish_reason": d.finish_reason,
        "total_tokens": d.n_generated,
        "generation_time_ms": round(d.generation_time_ms, 3),
        "prompt_tokens": d.n_prompt,
        "cached_tokens": d.n_cached,
        "slot_id": slot_id_out(d.slot_id),
    }
    if d.stop_string:
        ev["stop_string"] = d.stop_string
    return ev


def progress_event(p: Progress, request_id: str | None) -> dict[str, Any]:
    """Prompt-processing progress, llama-server's ``prompt_progress`` (``return_progress``).

    ``{"type": "progress", "request_id", "prompt_progress": {"total", "cache", "processed",
    "time_ms"}}``: ``processed / total`` prompt tokens are in the KV cache, ``cache`` of
    them were reused (llama-server's tools/server/README.md, ``return_progress``).
    """
    return {
        "type": "progress",
        "request_id": request_id,
        "prompt_progress": {"total": p.n_total, "cache": p.n_cached, "processed": p.n_done, "time_ms": p.t_ms},
    }


def kobold_token_event(text: str) -> dict[str, Any]:
    """KoboldCpp SSE text event (no attention); a stop token contributes no text."""
    return {"token": text, "finish_reason": None}


def kobold_done_event(d: DoneOut) -> dict[str, Any]:
    """KoboldCpp SSE final event."""
    return {"token": "", "finish_reason": KOBOLD_FINISH.get(d.finish_reason, d.finish_reason)}


def sse_attention_event(t: TokenOut, request_id: str | None, fmt: str, dtype: str) -> dict[str, Any]:
    """The SSE token event with attention (docs/api.md, "POST /api/extra/generate/stream"):
    ``{"type":"token","token":{token_id,text}, ...}``."""
    ev: dict[str, Any] = {"type": "token", "token": token_text_fields(t), "request_id": request_id}
    ev["attention"] = attention_json(t, fmt, dtype)
    hid = hidden_json(t)
    if hid is not None:
        ev["hidden_state"] = hid
    return ev


def binary_ws_token_frame(t: TokenOut) -> dict[str, Any]:
    """The binary WebSocket's text frame before its binary attention frame (docs/api.md,
    "WS /api/extra/generate/stream/ws")."""
    ev: dict[str, Any] = {"type": "token", **token_text_fields(t), "index": t.index}
    if t.attention is not None:
        ev["shape"] = t.attention_shape
    hid = hidden_json(t)
    if hid is not None:
        ev["hidden_state"] = hid
    return ev
