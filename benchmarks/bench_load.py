"""Overload: more WebSocket clients than engine sequences, with a real Redis; is waiting fair?

One ``slotserve serve --parallel 4 --redis-url`` on a ``redis-server`` this script starts
(``tests/redis_server.py``, own port and directory).  ``--clients`` (24) equal clients, each with
its own slot, chat for ``--duration`` seconds: every turn sends the whole conversation so far plus
a new user message as ``input_ids``, greedy, ``--new`` tokens, ``ignore_eos``.  ``--attention`` (12)
of them use the binary WebSocket (``/api/extra/generate/stream/ws``, per-layer float32 attention,
one connection per turn, as Halo Weave does); the others the JSON event WebSocket
(``/api/v1/generate/stream``, no attention, one connection for all turns).  A conversation that
would outgrow ``--max-context`` starts over.  After the deadline each client finishes its turn.

Printed: tokens per client (min, median, max, and the list), Jain's fairness index over them
((sum x)^2 / (n * sum x^2); 1 = perfectly equal), how many turns waited in the admission queue
(they got ``{"type":"queued"}`` frames) and those turns' wait until their first token (p50, p99),
the time to first token of every turn, and the errors by ``error_code``.

    .venv/bin/python benchmarks/bench_load.py [--duration 90] [--clients 24] [--attention 12]
        [--parallel 4] [--new 16] [--threads 2] [--ctx-size 2048] [--queue-size 64] [--keep-logs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import websockets
from common import http_tokenizer, user_turn
from servers import ServerProc, check, free_port, slotserve_cmd, stop_servers

from tests.redis_server import RedisServer

QUESTIONS = ["Tell me about lighthouses.", "Why is the sea salty?", "Name three rivers.", "What do owls eat?"]


@dataclass
class Client:
    """One simulated user: its slot, its conversation, and what it saw."""

    index: int
    attention: bool
    context: list[int] = field(default_factory=list)
    tokens: int = 0
    turns: int = 0
    queued_waits: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def slot(self) -> str:
        return f"load{self.index}"


def request_body(c: Client, args: argparse.Namespace) -> dict:
    return {
        "input_ids": c.context,
        "max_new_tokens": args.new,
        "temperature": 0,
        "ignore_eos": True,
        "id_slot": c.slot,
        "request_id": f"{c.slot}-{c.turns}",
        "output_attentions": c.attention,
    }


async def one_turn(ws, c: Client, args: argparse.Namespace, generated: list[int]) -> None:
    """Send one request on ``ws`` and read until ``done``/``error``; record what was seen."""
    t0 = time.monotonic()
    queued = False
    got_first = False
    await ws.send(json.dumps(request_body(c, args)))
    while True:
        msg = await asyncio.wait_for(ws.recv(), args.duration + 120)
        if isinstance(msg, bytes):  # the binary attention frame of the previous token
            continue
        ev = json.loads(msg)
        kind = ev.get("type")
        if kind == "queued":
            queued = True
        elif kind == "token":
            if not got_first:
                got_first = True
                wait = time.monotonic() - t0
                c.first_token.append(wait)
                if queued:
                    c.queued_waits.append(wait)
            c.tokens += 1
            # binary WS: {"token_id": ..}; JSON event WS: {"token": {"token_id": ..}}
            generated.append(int(ev["token_id"] if "token_id" in ev else ev["token"]["token_id"]))
        elif kind == "done":
            c.turns += 1
            return
        elif kind == "error":
            c.errors[ev.get("error_code", "?")] += 1
            await asyncio.sleep(1.0)  # what a polite client does after a refusal
            return


async def run_client(c: Client, base_ws: str, args: argparse.Namespace, turn_ids: list[list[int]], end: float) -> None:
    path = "/api/extra/generate/stream/ws" if c.attention else "/api/v1/generate/stream"
    ws = None
    try:
        while time.monotonic() < end:
            user = turn_ids[(c.index + c.turns) % len(turn_ids)]
            if len(c.context) + len(user) + args.new > args.max_context:
                c.context = []
            c.context = c.context + user
            generated: list[int] = []
            try:
                if ws is None:
                    ws = await websockets.connect(base_ws + path, max_size=None, compression=None)
                await one_turn(ws, c, args, generated)
            except (websockets.ConnectionClosed, OSError, TimeoutError) as exc:
                c.errors[type(exc).__name__] += 1
                ws = None
            c.context = c.context + generated
            if c.attention and ws is not None:  # the binary WS closes after each generation
                await ws.close()
                ws = None
    finally:
        if ws is not None:
            await ws.close()


def jain(xs: list[float]) -> float:
    """Jain's fairness index (R. Jain, D. Chiu, W. Hawe, DEC-TR-301, 1984)."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def report(clients: list[Client], args: argparse.Namespace, seconds: float) -> None:
    toks = [c.tokens for c in clients]
    print(
        f"\n{len(clients)} clients ({args.attention} with attention), --parallel {args.parallel}, "
        f"--queue-size {args.queue_size}, {seconds:.0f} s, {args.new} new tokens per turn, greedy"
    )
    print(f"tokens per client: min {min(toks)}, median {statistics.median(toks):g}, max {max(toks)}, total {sum(toks)}")
    print(f"  attention clients: {[c.tokens for c in clients if c.attention]}")
    print(f"  plain clients:     {[c.tokens for c in clients if not c.attention]}")
    print(f"Jain fairness index: {jain([float(t) for t in toks]):.3f}")
    waits = [w for c in clients for w in c.queued_waits]
    ttft = [w for c in clients for w in c.first_token]
    turns = sum(c.turns for c in clients)
    print(f"turns: {turns} done; {len(waits)} of {len(ttft)} turns that started waited in the queue")
    print(f"queued turns, wait until first token: p50 {pct(waits, 0.5):.2f} s, p99 {pct(waits, 0.99):.2f} s")
    print(f"all turns, time to first token:      p50 {pct(ttft, 0.5):.2f} s, p99 {pct(ttft, 0.99):.2f} s")
    errors: Counter[str] = Counter()
    for c in clients:
        errors.update(c.errors)
    print(f"errors: {dict(errors) if errors else 'none'}")


async def main_async(args: argparse.Namespace, srv: ServerProc) -> None:
    with httpx.Client(timeout=60) as http:
        tok = http_tokenizer(http, srv.base)
        turn_ids = [user_turn(tok, q) for q in QUESTIONS]
        check(http.get(srv.base + "/health"), "health")
    clients = [Client(i, attention=i < args.attention) for i in range(args.clients)]
    t0 = time.monotonic()
    end = t0 + args.duration
    base_ws = srv.base.replace("http://", "ws://")
    await asyncio.wait_for(
        asyncio.gather(*(run_client(c, base_ws, args, turn_ids, end) for c in clients)), args.duration + 300
    )
    report(clients, args, time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=90, help="seconds of load (default 90)")
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--attention", type=int, default=12, help="clients on the binary attention WebSocket")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--new", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--max-context", type=int, default=400, help="a conversation longer than this starts over")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument("--queue-size", type=int, default=64)
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    if args.duration > 600:
        ap.error("--duration is bounded to 600 s")
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    redis = RedisServer(tmp / "redis")
    srv = None
    try:
        redis.start()
        port = free_port()
        cmd = slotserve_cmd(
            port,
            tmp / "state",
            parallel=args.parallel,
            ctx_size=args.ctx_size,
            threads=args.threads,
            extra=["--redis-url", redis.url, "--key-prefix", "bench-load:", "--queue-size", str(args.queue_size)],
        )
        srv = ServerProc("slotserve", cmd, port, tmp / "slotserve.log")
        print(f"slotserve ready in {srv.wait_ready(httpx):.1f} s; Redis at {redis.url}", flush=True)
        asyncio.run(main_async(args, srv))
    finally:
        if srv is not None:
            srv.stop()
        redis.stop()
        stop_servers([], tmp, args.keep_logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
