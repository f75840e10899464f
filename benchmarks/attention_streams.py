"""One generation's attention as a server's streaming client reads it, for bench_stream.py: a WebSocket client of
``/api/extra/generate/stream/ws`` receiving each token's ``float32[L, H, ctx]`` attention as a binary frame,
an SSE client of ``POST /api/extra/generate/stream`` decoding it from base64 (docs/api.md), each token's
tensor checked (size, shape; rows summing to 1 on the first and last token), timed per token as a :class:`Rep`."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field

import numpy as np
from common import CpuMeter, SseEvents, ws_token_frames

# ----------------------------------------------------------------------------- results


@dataclass
class Rep:
    """One generation as seen by one consumer."""

    n: int
    t_prefill: float  # request sent / submitted -> first token complete (s)
    t_decode: float  # first token -> last token (s)
    tokens: list[int]
    # process -> CPU seconds over the whole rep; "decode:<process>" over first..last token; "other": cores
    cpu: dict[str, float] = field(default_factory=dict)
    cached: int | None = None  # server: prompt tokens reused from the slot's KV cache
    ext: str | None = None  # WS: negotiated extensions
    gaps: list[float] = field(default_factory=list)  # intervals between consecutive tokens (s)

    @property
    def tps(self) -> float:
        return (self.n - 1) / self.t_decode if self.t_decode > 0 else float("nan")


# ----------------------------------------------------------------------------- the server's clients


def request_body(ids: list[int], new: int) -> dict:
    return {
        "input_ids": ids,
        "max_length": new,
        "temperature": 0,
        "output_attentions": True,
        "ignore_eos": True,
        "wait": True,  # never SLOT_BUSY if a save still holds the slot
    }


async def ws_once(
    url: str, ids: list[int], new: int, shape: tuple[int, int], compression: str | None, meter: CpuMeter
) -> Rep:
    import websockets

    kw = {} if compression == "default" else {"compression": None}
    n_l, n_h = shape
    times: list[float] = []
    tokens: list[int] = []
    done = None
    async with websockets.connect(url, max_size=None, **kw) as ws:
        ext = ws.response.headers.get("Sec-WebSocket-Extensions")
        t0 = time.perf_counter()
        await ws.send(json.dumps(request_body(ids, new)))
        async for ev, frame in ws_token_frames(ws):
            if frame is None:
                done = ev
                break
            ctx = len(ids) + ev["index"]
            want = n_l * n_h * ctx * 4
            if len(frame) != want or ev.get("shape") != [n_l, n_h, ctx]:
                raise RuntimeError(f"ws token {ev['index']}: {len(frame)} bytes, shape {ev.get('shape')}")
            att = np.frombuffer(frame, dtype=np.float32).reshape(n_l, n_h, ctx)
            if ev["index"] in (0, new - 1) and not np.allclose(att.sum(-1), 1, atol=1e-3):
                raise RuntimeError(f"ws token {ev['index']}: rows do not sum to 1")
            times.append(time.perf_counter())
            tokens.append(ev["token_id"])
            if len(times) in (1, new):
                meter.mark("first" if len(times) == 1 else "last")
    assert done is not None, "ws stream ended without done"
    return Rep(len(times), times[0] - t0, times[-1] - times[0], tokens, cached=done.get("cached_tokens"), ext=ext)


def sse_once(client, url: str, ids: list[int], new: int, shape: tuple[int, int], meter: CpuMeter) -> Rep:
    n_l, n_h = shape
    times: list[float] = []
    tokens: list[int] = []
    done = None
    events = SseEvents()
    t0 = time.perf_counter()
    with client.stream("POST", url, json=request_body(ids, new)) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"sse: HTTP {resp.status_code} {resp.text[:300]}")
        for chunk in resp.iter_bytes():
            for ev in events.feed(chunk):
                if ev.get("type") == "token":
                    a = ev["attention"]
                    ctx = len(ids) + len(tokens)
                    raw = base64.b64decode(a["data"])
                    if len(raw) != n_l * n_h * ctx * 4 or a["shape"] != [n_l, n_h, ctx]:
                        raise RuntimeError(f"sse token {len(tokens)}: {len(raw)} bytes, shape {a['shape']}")
                    att = np.frombuffer(raw, dtype=np.float32).reshape(a["shape"])
                    if len(tokens) in (0, new - 1) and not np.allclose(att.sum(-1), 1, atol=1e-3):
                        raise RuntimeError(f"sse token {len(tokens)}: rows do not sum to 1")
                    times.append(time.perf_counter())
                    tokens.append(ev["token"]["token_id"])
                    if len(times) in (1, new):
                        meter.mark("first" if len(times) == 1 else "last")
                elif ev.get("type") == "done":
                    done = ev
                else:
                    raise RuntimeError(f"sse: {ev}")
    assert done is not None, "sse stream ended without done"
    return Rep(len(times), times[0] - t0, times[-1] - times[0], tokens, cached=done.get("cached_tokens"))
