"""Fairness between tenants: tenant X floods the server while tenant Y sends one stream at a time.

One slotserve server (default model, ``--parallel`` sequences, an ``--api-keys`` file with tenants
``x`` and ``y``). First Y alone: ``--y-requests`` streams one after the other. Then the same Y
streams while X keeps ``--x-streams`` streams running at once (each X client sends its next request
as soon as its last one ended). Every stream is ``POST /api/extra/generate/stream`` on its client's
conversation (``conversation_id``; the same short prompt each time, so its prefix is cached and the
figures measure the scheduling, not prefill), ``--max-tokens`` tokens, greedy, ``ignore_eos``.

Printed: Y's time to first token (median, max) and decode tok/s alone and beside X; X's aggregate
tok/s; each tenant's engine share (the mean number of engine sequences its generations held: the
sum of their first-token-to-end times over the flood's wall time) against its max-min fair share
(Y asks for one sequence at a time, X for the rest), and Jain's fairness index over the two
normalized shares (1.0: each got its fair share; 0.5: one got nothing).

    .venv/bin/python benchmarks/bench_tenants.py --parallel 4 --x-streams 32 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import sse_events
from servers import ServerProc, free_port, slotserve_cmd

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Timed:
    """One stream: when it was sent, its token times (perf_counter seconds)."""

    tenant: str
    t_send: float
    times: list[float]

    @property
    def ttft(self) -> float:
        return self.times[0] - self.t_send

    @property
    def tps(self) -> float:
        span = self.times[-1] - self.times[0]
        return (len(self.times) - 1) / span if span > 0 else float("nan")

    @property
    def held(self) -> float:
        """Seconds its generation held an engine sequence (first token to last, about)."""
        return self.times[-1] - self.times[0]


async def stream(client: httpx.AsyncClient, base: str, key: str, tenant: str, conv: str, n: int) -> Timed:
    body = {
        "prompt": CHAT.format(f"Tell me a short story about {conv}."),
        "max_new_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "conversation_id": conv,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", base + "/api/extra/generate/stream", json=body, headers=headers) as r:
        r.raise_for_status()
        async for ev in sse_events(r):
            if "token" in ev and ev.get("finish_reason") is None:
                times.append(time.perf_counter())
    assert times, f"{conv}: no tokens"
    return Timed(tenant, t0, times)


def jain(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2)."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def summary(name: str, runs: list[Timed]) -> str:
    ttft = [r.ttft * 1000 for r in runs]
    tps = [r.tps for r in runs]
    return (
        f"{name}: {len(runs)} streams, time to first token median {statistics.median(ttft):.0f} ms,"
        f" max {max(ttft):.0f} ms; decode {statistics.median(tps):.1f} tok/s (median)"
    )


async def main_async(a: argparse.Namespace, base: str) -> None:
    limits = httpx.Limits(max_connections=a.x_streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream(client, base, "key-y", "y", "y", 4)  # makes Y's conversation
        alone = [await stream(client, base, "key-y", "y", "y", a.max_tokens) for _ in range(a.y_requests)]
        stop = asyncio.Event()
        x_runs: list[Timed] = []

        async def x_client(i: int) -> None:
            while not stop.is_set():
                x_runs.append(await stream(client, base, "key-x", "x", f"x-{i}", a.max_tokens))

        xs = [asyncio.create_task(x_client(i)) for i in range(a.x_streams)]
        await asyncio.sleep(a.warmup_s)  # X's streams fill every sequence and the queue
        t0 = time.perf_counter()
        beside = [await stream(client, base, "key-y", "y", "y", a.max_tokens) for _ in range(a.y_requests)]
        t1 = time.perf_counter()
        stop.set()
        for x in xs:  # X's requests still waiting or running are dropped (their clients leave)
            x.cancel()
        await asyncio.gather(*xs, return_exceptions=True)
    window = [r for r in x_runs if r.times[0] >= t0 and r.times[-1] <= t1]
    x_tokens = sum(1 for r in x_runs for t in r.times if t0 <= t <= t1)
    share_y = sum(r.held for r in beside) / (t1 - t0)
    share_x = sum(min(r.times[-1], t1) - max(r.times[0], t0) for r in x_runs if r.times[-1] > t0 and r.times[0] < t1)
    share_x /= t1 - t0
    fair_y = 1.0  # Y asks for one sequence at a time
    fair_x = a.parallel - fair_y
    index = jain([share_y / fair_y, share_x / fair_x])
    print(summary("Y alone", alone))
    print(summary(f"Y beside X's {a.x_streams} streams", beside))
    print(f"X: {x_tokens / (t1 - t0):.1f} tok/s aggregate over {t1 - t0:.1f} s ({len(window)} streams wholly inside)")
    print(
        f"engine share (sequences held): Y {share_y:.2f} of its fair {fair_y:.0f}, X {share_x:.2f} of its fair"
        f" {fair_x:.0f}; Jain index {index:.3f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--x-streams", type=int, default=32)
    p.add_argument("--y-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--keep-logs", action="store_true")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    keys = tmp / "keys.txt"
    keys.write_text("key-x x\nkey-y y\n")
    port = free_port()
    cmd = slotserve_cmd(
        port, tmp / "state", parallel=a.parallel, ctx_size=a.ctx_size, threads=a.threads,
        extra=["--api-keys", str(keys), "--queue-size", str(a.x_streams + 8), "--queue-timeout", "1800"],
    )  # fmt: skip
    srv = ServerProc("slotserve", cmd, port, tmp / "slotserve.log")
    try:
        srv.wait_ready(httpx)
        asyncio.run(main_async(a, srv.base))
    finally:
        srv.stop()
        if a.keep_logs:
            print(f"logs in {tmp}")


if __name__ == "__main__":
    main()
