"""The cost of ``--durability strict`` per turn against ``write-behind``, by context length, and the bytes a turn
writes; then many conversations sharing one system prompt: the store's bytes beside one copy of its KV.

1. **Per turn**: for each store (``--store``: ``directory``, the embedded default; ``redis``: a throw-away
   redis-server the benchmark starts on a free port, tests/redis_server.py; ``both``) and each durability, one
   slotserve (``--parallel 1``); per context length (``--sizes``, default 300,1000,2000,4000,8000: SmolLM2-135M's
   window is 8,192, the turns fit after 8,000) one conversation is prefilled (not timed), then ``--turns``
   turns each append 8 tokens and generate 2 (a 10-token turn, ``POST /api/v1/generate`` with ``input_ids`` and
   ``id_slot``, greedy).  Printed: the median turn time, strict minus write-behind (what strict adds), the
   strict commit's own time inside the turn (``slotserve_durable_commit_seconds``: unlike the difference of two
   runs, it does not move with what else the machine runs), and the
   bytes the turn wrote (``slotserve_state_bytes_written_total``'s growth for an incremental state; the stored
   blob's size where the state is stored whole).  Then per store and length: the strict and the write-behind
   turn, what strict adds, the strict commit and the bytes written per turn.
2. **Sharing** (with the directory store): ``--shared`` conversations (default 64, 0: skip) on one slotserve
   (directory store, strict) each start with
   the same ``--system`` tokens (default 1,000) and a few of their own; printed: the bytes of the store's KV
   chunks and slot files beside the bytes of one copy of the system prompt's KV (its tokens x the bytes per
   token of a state read back through ``save-state``).

    .venv/bin/python benchmarks/bench_durability_turns.py [--sizes 300,1000,2000,4000,8000] [--turns 4]
        [--store directory|redis|both] [--shared 64] [--system 1000] [--threads 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import build_prompt, http_tokenizer, user_turn
from servers import ServerProc, free_port, slotserve_cmd

METRIC = re.compile(r"^slotserve_state_bytes_written_total ([0-9.e+]+)$", re.M)
COMMIT = re.compile(r"^slotserve_durable_commit_seconds_sum ([0-9.e+-]+)$", re.M)


def written(client: httpx.Client, base: str) -> float:
    m = METRIC.search(client.get(base + "/metrics").text)
    return float(m.group(1)) if m else 0.0


def settled_written(client: httpx.Client, base: str) -> float:
    """:func:`written` once it stopped growing for a second (a write-behind save in flight has ended: on a loaded
    machine the first save of a long prefill takes seconds, and would be counted in the next turn's bytes)."""
    last = written(client, base)
    while True:
        time.sleep(1.0)
        now = written(client, base)
        if now == last:
            return now
        last = now


def commit_s(client: httpx.Client, base: str) -> float:
    """The strict commits' total time so far (``slotserve_durable_commit_seconds``' sum)."""
    m = COMMIT.search(client.get(base + "/metrics").text)
    return float(m.group(1)) if m else 0.0


def generate(client: httpx.Client, base: str, slot: str, ids: list[int], n: int) -> None:
    body = {"input_ids": ids, "max_new_tokens": n, "temperature": 0, "id_slot": slot, "ignore_eos": True}
    client.post(base + "/api/v1/generate", json=body).raise_for_status()


def slot_tokens(client: httpx.Client, base: str, slot: str) -> list[int]:
    r = client.post(f"{base}/slots/{slot}", params={"action": "tokens"})
    r.raise_for_status()
    return list(r.json()["tokens"])


def stored_bytes(client: httpx.Client, base: str, slot: str) -> int:
    for s in client.get(base + "/slots").json():
        if str(s.get("id")) == slot:
            return int(s.get("stored_bytes") or 0)
    return 0


def start(tmp: Path, name: str, ctx: int, threads: int, extra: list[str]) -> ServerProc:
    port = free_port()
    cmd = slotserve_cmd(port, tmp / name, parallel=1, ctx_size=ctx, threads=threads, extra=extra)
    srv = ServerProc(name, cmd, port, tmp / f"{name}.log")
    srv.wait_ready(httpx)
    return srv


def per_turn(args: argparse.Namespace, tmp: Path, store: str, durability: str, redis_url: str) -> dict[int, tuple]:
    extra = ["--durability", durability, "--write-delay-ms", "200"]
    if store == "redis":
        extra += ["--redis-url", redis_url, "--key-prefix", f"b-{durability}:"]
    srv = start(tmp, f"{store}-{durability}", max(args.sizes) + 16 * args.turns + 64, args.threads, extra)
    out = {}
    try:
        with httpx.Client(timeout=600) as client:
            tok = http_tokenizer(client, srv.base)
            turn = user_turn(tok, "Go on.")[:8]
            for n in args.sizes:
                slot = f"c{n}"
                ids = build_prompt(tok, n - 2)
                generate(client, srv.base, slot, ids, 2)
                times, sizes, commits = [], [], []
                for _ in range(args.turns):
                    ids = [*slot_tokens(client, srv.base, slot), *turn]
                    before = settled_written(client, srv.base)  # the save of the state before is done
                    c0 = commit_s(client, srv.base)
                    t0 = time.perf_counter()
                    generate(client, srv.base, slot, ids, 2)
                    times.append(time.perf_counter() - t0)
                    commits.append(commit_s(client, srv.base) - c0)
                    grew, deadline = 0.0, time.monotonic() + 30
                    while not grew and time.monotonic() < deadline:  # the write-behind's save may take a while
                        time.sleep(0.5)
                        grew = written(client, srv.base) - before
                    sizes.append(grew if grew else stored_bytes(client, srv.base, slot))
                out[n] = (statistics.median(times) * 1000, statistics.median(sizes), statistics.median(commits) * 1000)
                ms, mb, cm = out[n][0], out[n][1] / 1e6, out[n][2]
                print(f"  {store:9} {durability:12} {n:5} tokens: turn {ms:7.1f} ms (strict commit {cm:6.1f} ms), "
                      f"{mb:7.3f} MB written")  # fmt: skip
    finally:
        srv.stop()
    return out


def sharing(args: argparse.Namespace, tmp: Path) -> None:
    srv = start(tmp, "shared", args.system + 128, args.threads, ["--durability", "strict"])
    try:
        with httpx.Client(timeout=600) as client:
            tok = http_tokenizer(client, srv.base)
            system = build_prompt(tok, args.system)
            for i in range(args.shared):
                own = user_turn(tok, f"Conversation {i}: name a colour.")
                generate(client, srv.base, f"s{i}", [*system, *own], 2)
            r = client.post(f"{srv.base}/slots/s0", params={"action": "save-state"},
                            headers={"Accept": "application/octet-stream"})  # fmt: skip
            r.raise_for_status()
            n0 = len(slot_tokens(client, srv.base, "s0"))
            per_token = len(r.content) / n0
    finally:
        srv.stop()
    root = tmp / "shared"
    chunks = sum(p.stat().st_size for p in root.rglob("chunks/*/*"))
    slots = sum(p.stat().st_size for p in root.rglob("slot.bin"))
    print(f"  {args.shared} conversations sharing a {args.system}-token system prompt:")
    print(f"  store: KV chunks {chunks / 1e6:.1f} MB + slot files {slots / 1e6:.2f} MB")
    print(f"  one copy of the system prompt's KV: {args.system * per_token / 1e6:.1f} MB "
          f"({per_token / 1e3:.1f} KB/token); each conversation's own tokens: about "
          f"{(n0 - args.system) * per_token / 1e6:.2f} MB")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[300, 1000, 2000, 4000, 8000])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--store", choices=["directory", "redis", "both"], default="directory",
                    help="the store(s) measured (redis: a throw-away redis-server on a free port)")  # fmt: skip
    ap.add_argument("--shared", type=int, default=64)
    ap.add_argument("--system", type=int, default=1000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-durability-"))
    stores = ["directory", "redis"] if args.store == "both" else [args.store]
    redis = None
    if "redis" in stores:
        from tests.redis_server import RedisServer  # the repository root on PYTHONPATH

        redis = RedisServer(tmp / "redis")
        redis.start()
    try:
        for store in stores:
            res = {d: per_turn(args, tmp, store, d, redis.url if redis else "") for d in ("write-behind", "strict")}
            for n in args.sizes:
                strict, behind = res["strict"][n][0], res["write-behind"][n][0]
                cm, mb = res["strict"][n][2], res["strict"][n][1] / 1e6
                print(f"{store:9} {n:5} tokens: per 10-token turn strict {strict:6.1f} ms, write-behind "
                      f"{behind:6.1f} ms (strict adds {strict - behind:6.1f} ms; its commit {cm:.1f} ms); "
                      f"{mb:.3f} MB written per turn")  # fmt: skip
        if args.shared and "directory" in stores:
            sharing(args, tmp)
    finally:
        if redis is not None:
            redis.stop()
    print(f"logs in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
