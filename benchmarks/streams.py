"""Concurrent stream clients of bench_slots.py and bench_table.py: slotserve SSE / WS (with or without
attention) and llama-server ``/completion`` streams, timestamped per token (see bench_slots.py for
how the aggregate rate is measured)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field

import httpx
from common import (
    Quiet,
    sse_events,
    ws_token_frames,
)
from servers import check

# ----------------------------------------------------------------------------- one run of N streams


@dataclass
class Stream:
    t_send: float = 0.0
    times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    cached: int | None = None


@dataclass
class Run:
    """N concurrent streams of one path."""

    streams: list[Stream]

    @property
    def window(self) -> tuple[float, float]:
        return max(s.times[0] for s in self.streams), min(s.times[-1] for s in self.streams)

    @property
    def tps(self) -> float:
        """Aggregate decode tok/s while every stream decodes."""
        a, b = self.window
        if b <= a:
            return float("nan")
        n = sum(1 for s in self.streams for t in s.times if a < t <= b)
        return n / (b - a)

    @property
    def longest_gap(self) -> float:
        """The longest interval (s) between two consecutive tokens of any one stream, both inside the
        window (the stall a stream's reader sees while every stream decodes)."""
        a, b = self.window
        gaps = [y - x for s in self.streams for x, y in itertools.pairwise(s.times) if a <= x and y <= b]
        return max(gaps, default=float("nan"))

    @property
    def ttft(self) -> float:
        return max(s.times[0] - s.t_send for s in self.streams)

    @property
    def wall_tps(self) -> float:
        """All tokens / (first request sent .. last token): includes prefill and stragglers."""
        t0 = min(s.t_send for s in self.streams)
        t1 = max(s.times[-1] for s in self.streams)
        return sum(len(s.times) for s in self.streams) / (t1 - t0)


class Marks:
    """Marks the CPU meter when every stream has its first token and when the first stream ends (the
    :attr:`Run.window`), and sets :attr:`decoding` and :attr:`ending` then (for work run beside the streams)."""

    def __init__(self, quiet: Quiet, n_streams: int, n_new: int) -> None:
        self.quiet, self.n, self.new = quiet, n_streams, n_new
        self.started = self.ended = 0
        self.decoding = asyncio.Event()
        self.ending = asyncio.Event()

    def token(self, s: Stream) -> None:
        s.times.append(time.perf_counter())
        if len(s.times) == 1:
            self.started += 1
            if self.started == self.n:
                self.quiet.meter.mark("first")
                self.decoding.set()
        if len(s.times) == self.new:
            self.ended += 1
            if self.ended == 1:
                self.quiet.meter.mark("last")
                self.ending.set()


BANNED: list[int] = []
"""The model's end-of-generation tokens: llama-server's ``ignore_eos`` bans them (logit bias -inf),
slotserve's only does not stop on them, so slotserve requests ban them explicitly (same load)."""


def model_shape(client: httpx.Client, base: str) -> tuple[int, int]:
    """``(layers, attention heads)`` of a slotserve's model (``GET /api/v1/model``); sets :data:`BANNED` to
    its end-of-generation tokens."""
    info = check(client.get(base + "/api/v1/model"), "model info")
    BANNED[:] = info["eog_token_ids"]
    return info["num_layers"], info["num_attention_heads"]


def slotserve_body(ids: list[int], slot: int, new: int, attention: bool) -> dict:
    return {
        "banned_tokens": BANNED,
        "input_ids": ids,
        "max_new_tokens": new,
        "temperature": 0,
        "ignore_eos": True,
        "id_slot": slot,
        "output_attentions": attention,
        "wait": True,
    }


async def slotserve_sse(
    client: httpx.AsyncClient, base: str, ids: list[int], slot: int, new: int, m: Marks, aggregated: bool = False
) -> Stream:
    """One stream of KoboldCpp's SSE; ``aggregated``: with Halo Weave's attention (the mean over layers and
    heads per token, ``float32[ctx]`` base64 in each event), checked for size."""
    s = Stream(t_send=time.perf_counter())
    body = slotserve_body(ids, slot, new, aggregated)
    if aggregated:
        body["attention_format"] = "aggregated"
    async with client.stream("POST", base + "/api/extra/generate/stream", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"slotserve SSE: HTTP {resp.status_code} {resp.text[:300]}")
        async for ev in sse_events(resp):
            if ev.get("type") == "token":
                n = len(ev["attention"]["data"]) * 3 // 4 - ev["attention"]["data"].count("=")
                if n != 4 * (len(ids) + len(s.times)):
                    raise RuntimeError(f"slotserve SSE token {len(s.times)}: {n} attention bytes")
                m.token(s)
                s.text.append(ev["token"]["text"])
            elif ev.get("finish_reason") is None and "token" in ev:
                m.token(s)
                s.text.append(ev["token"])
            elif "error" in ev or ev.get("type") == "error":
                raise RuntimeError(f"slotserve SSE: {ev}")
    return s


async def slotserve_ws(
    url: str, ids: list[int], slot: int, new: int, shape: tuple[int, int], m: Marks, attention: bool = True
) -> Stream:
    """One stream on the binary WebSocket; with ``attention`` every token's float32 ``[L, H, ctx]`` frame
    is checked for size (a token counts once it arrived), without it only the JSON token frames come."""
    import websockets

    s = Stream()
    n_l, n_h = shape
    async with websockets.connect(url, max_size=None, compression=None) as ws:
        s.t_send = time.perf_counter()
        await ws.send(json.dumps(slotserve_body(ids, slot, new, attention)))
        async for ev, frame in ws_token_frames(ws, attention):
            if frame is None:
                s.cached = ev.get("cached_tokens")
                break
            want = n_l * n_h * (len(ids) + ev["index"]) * 4 if attention else 0
            if len(frame) != want:
                raise RuntimeError(f"slotserve WS token {ev['index']}: {len(frame)} bytes, want {want}")
            m.token(s)
            s.text.append(ev["text"])
    return s


async def llama_sse(client: httpx.AsyncClient, base: str, ids: list[int], slot: int, new: int, m: Marks) -> Stream:
    s = Stream(t_send=time.perf_counter())
    body = {
        "prompt": ids,
        "n_predict": new,
        "temperature": 0,
        "ignore_eos": True,
        "id_slot": slot,
        "cache_prompt": True,
        "stream": True,
        "return_tokens": True,
    }
    async with client.stream("POST", base + "/completion", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"llama-server: HTTP {resp.status_code} {resp.text[:300]}")
        n = 0
        async for ev in sse_events(resp):
            if "error" in ev:
                raise RuntimeError(f"llama-server: {ev}")
            if ev.get("stop"):
                s.cached = ev.get("tokens_cached")
                timings = ev.get("timings") or {}
                s.cached = timings.get("cache_n", s.cached)
                continue
            got = ev.get("tokens_predicted", n + 1)
            for _ in range(got - n):
                m.token(s)
            n = got
            s.text.append(ev.get("content", ""))
    return s


async def run_streams(
    kind: str, base: str, prompts: list[list[int]], n: int, new: int, shape: tuple[int, int], m: Marks
) -> Run:
    """``n`` concurrent streams, stream ``i`` on slot ``i`` with ``prompts[i]``, on the server at ``base``.

    ``kind``: ``sse`` (slotserve SSE, no attention), ``sse-agg`` (the same with aggregated attention),
    ``ws`` (slotserve WS + full attention),
    ``ws-plain`` (the same WebSocket without attention) or ``llama`` (llama-server ``/completion``).
    """
    async with httpx.AsyncClient(timeout=None) as client:
        if kind in ("sse", "sse-agg"):
            coros = [slotserve_sse(client, base, prompts[i], i, new, m, kind == "sse-agg") for i in range(n)]
        elif kind in ("ws", "ws-plain"):
            url = "ws" + base.removeprefix("http") + "/api/extra/generate/stream/ws"
            coros = [slotserve_ws(url, prompts[i], i, new, shape, m, kind == "ws") for i in range(n)]
        elif kind == "llama":
            coros = [llama_sse(client, base, prompts[i], i, new, m) for i in range(n)]
        else:
            raise ValueError(f"unknown stream kind {kind!r}")
        return Run(list(await asyncio.gather(*coros)))


Beside = Callable[[Marks], Coroutine[None, None, None]]
"""Work run beside the streams on their event loop (``beside(marks)``): it may wait for ``marks.decoding`` and
should return soon after ``marks.ending`` is set (both are set when the streams end, in any case)."""


async def _beside(streams: Awaitable[Run], beside: Beside, marks: Marks) -> Run:
    side = asyncio.create_task(beside(marks))
    try:
        return await streams
    finally:
        marks.decoding.set()
        marks.ending.set()
        await side


def measure_streams(
    quiet: Quiet, kind: str, base: str, prompts: list[list[int]], n: int, new: int, shape: tuple[int, int],
    label: str, warm: bool, beside: Beside | None = None,
) -> tuple[Run, dict[str, float]]:  # fmt: skip
    """:func:`run_streams` through :meth:`Quiet.run` (idle machine, CPU marks), with ``beside`` (if any) running
    on the same event loop (see :data:`Beside`); checks every stream got ``new`` tokens. Returns ``(run, cpu)``."""
    box: list[Marks] = []

    def go() -> Run:
        box[:] = [Marks(quiet, n, new)]
        streams = run_streams(kind, base, prompts, n, new, shape, box[0])
        return asyncio.run(_beside(streams, beside, box[0]) if beside else streams)

    run, cpu = quiet.run(go, label, warm=warm)
    for i, s in enumerate(run.streams):
        if len(s.times) != new:
            raise RuntimeError(f"{label} stream {i}: {len(s.times)} tokens, want {new}")
    return run, cpu
