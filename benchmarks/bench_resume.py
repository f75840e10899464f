"""Resume after a process restart: time to first token of a stored conversation against a cold prefill.

One slotserve (``--parallel 2``, its default strict durability, the embedded store in a directory or
``--store redis``: a throw-away ``redis-server``) holds one conversation of ``--tokens`` tokens in slot 0.
Each rep stops the server with ``SIGKILL`` (nothing is flushed at exit: what a crash leaves), starts a new
one on the same store, and times, from the request to the first streamed token, the conversation's next
turn: ``POST /completion`` (llama-server's API) with ``id_slot`` 0, the conversation plus a short user turn,
``cache_prompt``, ``n_predict`` 1, streamed.  The new server finds slot 0 parked in the store and restores
it (its ``timings.prompt_n``, printed, says how many tokens it still had to evaluate: the user turn, not the
conversation).  Beside it, on the same server:

* **resident**: the same kind of turn once the slot is in the KV cache again (the turn's own prefill and
  first token: what a resume adds is the difference);
* with ``--warm``, before the resume, one 16-token request on slot 1 (then erased), so the resume is not the new
  server's first request: what a first request costs apart from the restore;
* **cold**: slot 1, a prompt of the same length that shares no prefix with the conversation (another
  prompt variant: no stored KV chunk of slot 0 applies), so all of it is prefilled; slot 1 is erased after
  each rep.

Medians of ``--reps`` in ms and the ratio resume / cold (issue goal: <= 0.02 at 4,000 tokens).  The machine's
load average is printed before and after: speed figures are only meaningful on a quiet machine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_resume.py [--tokens 4000] [--reps 3] [--store dir|redis]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import build_prompt, http_tokenizer, load, machine, user_turn
from servers import ServerProc, check, default_model, free_port, settle, slotserve_cmd, stop_servers

from tests.redis_server import RedisServer


def first_token(client: httpx.Client, base: str, slot: int, ids: list[int]) -> tuple[float, int, int]:
    """One streamed ``/completion`` of one token on ``id_slot`` ``slot``: ms from the request to the first
    event carrying a token, the token, and ``timings.prompt_n`` of the last event (the prompt tokens the
    server evaluated; -1 if absent)."""
    body = {"prompt": ids, "n_predict": 1, "temperature": 0, "id_slot": slot, "cache_prompt": True,
            "stream": True, "return_tokens": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft, token, evaluated = -1.0, -1, -1
    with client.stream("POST", base + "/completion", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"slot {slot}: HTTP {resp.status_code} {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(f"slot {slot}: {ev}")
            if ev.get("tokens") and ttft < 0:
                ttft, token = (time.perf_counter() - t0) * 1000, ev["tokens"][0]
            evaluated = int((ev.get("timings") or {}).get("prompt_n", evaluated))
    if ttft < 0:
        raise RuntimeError(f"slot {slot}: no token streamed")
    return ttft, token, evaluated


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000, help="the stored conversation's length")
    ap.add_argument("--reps", type=int, default=3, help="restarts (and cold prefills)")
    ap.add_argument("--store", choices=("dir", "redis"), default="dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=4608, help="context per slot (room for the turns)")
    ap.add_argument(
        "--warm", action="store_true", help="before the resume, one short request on slot 1 (the new server's first)"
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    model = args.model or default_model()
    tmp = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    print(f"{machine()}; {model.name}; a {args.tokens}-token conversation, store: {args.store}")
    print(f"load before: {load()}")
    redis = RedisServer(tmp / "redis", extra_args=["--appendonly", "no"]) if args.store == "redis" else None
    # one --node-id across the restarts: the new process is the same node and takes its leases back at once (a
    # node of another id waits for the killed one's leases to lapse: docs/operations.md, multi-node ownership)
    extra = ["--redis-url", redis.url, "--key-prefix", "bench-resume:", "--node-id", "bench-resume"] if redis else []
    servers: list[ServerProc] = []

    def start(n: int) -> ServerProc:
        port = free_port()
        cmd = slotserve_cmd(
            port, tmp / "state", parallel=2, ctx_size=args.ctx_size, threads=args.threads, model=model, extra=extra
        )
        srv = ServerProc(f"slotserve {n}", cmd, port, tmp / f"slotserve{n}.log")
        servers.append(srv)
        srv.wait_ready(httpx)
        return srv

    rows: dict[str, list[float]] = {"resume": [], "resident": [], "cold": []}
    evaluated: dict[str, list[int]] = {k: [] for k in rows}
    try:
        if redis:
            redis.start()
        srv = start(0)
        with httpx.Client(timeout=600) as client:
            tok = http_tokenizer(client, srv.base)
            conv = build_prompt(tok, args.tokens, variant=1)
            cold = build_prompt(tok, args.tokens, variant=2)
            append = user_turn(tok, "Go on, please.")
            _, t, _ = first_token(client, srv.base, 0, conv)  # the conversation, prefilled and stored (strict)
            conv.append(t)
            for rep in range(args.reps):
                settle(client, srv.base)
                srv.proc.send_signal(signal.SIGKILL)
                srv.proc.wait()
                srv = start(rep + 1)
                if args.warm:  # what a new server's first request costs, apart from the restore
                    first_token(client, srv.base, 1, cold[:16])
                    check(client.post(srv.base + "/slots/1", params={"action": "erase"}), "erase slot 1")
                for name in ("resume", "resident"):
                    conv += append
                    ms, t, n = first_token(client, srv.base, 0, conv)
                    conv.append(t)
                    rows[name].append(ms)
                    evaluated[name].append(n)
                ms, _, n = first_token(client, srv.base, 1, cold)
                rows["cold"].append(ms)
                evaluated["cold"].append(n)
                check(client.post(srv.base + "/slots/1", params={"action": "erase"}), "erase slot 1")
                print(f"  rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in rows.items()))
    finally:
        stop_servers(servers, tmp, args.keep_logs)
        if redis:
            redis.stop()
    print(f"load after: {load()}; the conversation at the end: {len(conv)} tokens")
    med = {k: statistics.median(v) for k, v in rows.items()}
    for k, v in rows.items():
        print(f"{k:9s} time to first token {med[k]:9.1f} ms (min {min(v):.1f}); prompt tokens evaluated {evaluated[k]}")
    added = med["resume"] - med["resident"]
    print(f"resume / cold prefill: {med['resume'] / med['cold']:.4f}; resume - resident: {added:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
