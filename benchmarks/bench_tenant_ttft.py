"""Another tenant's guess at a cached prompt: time to first token and ``cached_tokens`` (the side
channel of vLLM's CVE-2025-46570; docs/operations.md, "Slots by tenant").

A slotserve with two tenants (``--api-keys``): tenant A sends a private memo (OpenAI chat, no slot
id), so A's anonymous slot caches it.  Then tenant B sends, alternately, ``--tries`` times each:

* the *right guess*: A's memo plus a question;
* a *wrong guess*: another memo of the same length plus the same question.

Each of B's requests is streamed; TTFT is the time to the first content chunk, ``cached_tokens``
comes from the final usage chunk.  Before tenants, the right guess was served from A's cache
(120-147 ms against 4.1-4.4 s, ``cached_tokens`` 409-458): an exact oracle.  Now both must be
misses: ``cached_tokens`` 0 for every try, and TTFT distributions alike.  B's own requests
would hit B's own cache, so every try gets a fresh ``cache_salt`` (B's own partition each time).
Also printed: A's own follow-up (same tenant, same salt: a hit) as the control.

    .venv/bin/python benchmarks/bench_tenant_ttft.py [--tries 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import ServerProc, free_port, slotserve_cmd

MEMO = (
    "Private memo for the board: the Lisbon office closes in March, the Porto team moves to remote work, "
    "and the budget for the new data centre is cut by a third. Nobody outside the board may know this yet. "
    "The announcement is planned for the first Monday of April, after the quarterly results. "
)
OTHER = (
    "Garden notes for the spring: the tomatoes go in after the last frost, the roses need pruning in "
    "February, and the pond pump must be cleaned before the frogs arrive. Order new seed potatoes early. "
    "The compost heap is turned every second week, and the rain barrel is emptied before any hard freeze. "
)
QUESTION = " Summarise this in one line."


def stream(base: str, key: str, text: str, salt: str | None) -> tuple[float, int]:
    """(seconds to the first content chunk, cached_tokens) of one streamed chat request."""
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    first, cached = None, -1
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert first is not None
    return first, cached


def show(name: str, xs: list[float], cached: list[int]) -> None:
    ms = sorted(x * 1000 for x in xs)
    print(
        f"{name:>12}: n={len(ms)} TTFT ms min {ms[0]:.0f} median {statistics.median(ms):.0f} max {ms[-1]:.0f}"
        f" | all: {' '.join(f'{x:.0f}' for x in ms)} | cached_tokens {sorted(set(cached))}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-tenant-ttft-"))
    keys = tmp / "keys.txt"
    keys.write_text("key-a tenant-a\nkey-b tenant-b\n")
    port = free_port()
    cmd = slotserve_cmd(port, tmp / "state", parallel=2, ctx_size=2048, threads=args.threads)
    srv = ServerProc("slotserve", [*cmd, "--api-keys", str(keys)], port, tmp / "slotserve.log")
    try:
        srv.wait_ready(httpx)
        base = srv.base
        stream(base, "key-a", MEMO, None)  # A's memo, cached in A's anonymous slot
        right: list[float] = []
        wrong: list[float] = []
        right_cached: list[int] = []
        wrong_cached: list[int] = []
        for i in range(args.tries):
            for text, times, cached in ((MEMO, right, right_cached), (OTHER, wrong, wrong_cached)):
                t, c = stream(base, "key-b", text + QUESTION, f"try-{i}-{len(times)}-{text[:4]}")
                times.append(t)
                cached.append(c)
        own_t, own_c = stream(base, "key-a", MEMO + QUESTION, None)
        print(f"slotserve {' '.join(cmd[2:])} (this machine; other load not controlled)")
        show("right guess", right, right_cached)
        show("wrong guess", wrong, wrong_cached)
        show("A's own", [own_t], [own_c])
        if any(right_cached) or any(wrong_cached):
            print("FAIL: tenant B was served from a cache it did not make", file=sys.stderr)
            sys.exit(1)
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
