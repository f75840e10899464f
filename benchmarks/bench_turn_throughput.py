"""Conversation turns through llama-server's ``/completion``: slotserve with ``--durability strict`` and
``write-behind`` beside llama-server built from the same llama.cpp, in one run.

Three servers run at once (idle ones cost no CPU): slotserve ``--parallel 4 --ctx-size C`` twice (strict, the
default, and write-behind; each with its own embedded store) and, with ``--llama-server PATH``, ``llama-server -np
4 -c 4C`` with its defaults (``--llama-args``, repeatable: one llama-server per value, with those extra
arguments, e.g. ``-fa off``). Each server gets the same ``--convs`` conversations (default 4), each of
``--prompt`` tokens (default 1,900; different from their first tokens on), prefilled by an untimed first turn.
Then ``--turns`` measured turns: every conversation appends a user message (~10 tokens) and generates
``--new`` tokens (default 48, greedy, ``ignore_eos``), streamed: ``POST /completion`` with the whole
conversation as token ids, ``id_slot`` = its index, ``cache_prompt``, ``return_tokens`` (the generated ids
are appended for the next turn, so the next prompt extends the cached one on both servers).

Per turn two loads, interleaved across the servers (turn t of each server, then turn t + 1): the first
conversation alone, then all of them together. A turn's tok/s is its generated tokens over its wall time,
from the first request's send to the last stream's end: prefill of the appended tokens, decode, and what
the server does before it answers the last token (the strict durable commit among it). Each timed turn waits
``--pause`` s first, so no server's write-behind save of an earlier turn runs inside another's timed turn.
Printed beside: the prompt tokens each server evaluated per request (``timings.prompt_n``), which shows
whether its cache held the conversation. Printed: each
server's median tok/s per load, strict / write-behind, and each slotserve / llama-server.

    .venv/bin/python benchmarks/bench_turn_throughput.py --llama-server PATH [--llama-args "" --llama-args "-fa off"]
        [--convs 4] [--prompt 1900]
        [--new 48] [--turns 5] [--threads 2] [--ctx-size 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import build_prompt, http_tokenizer, load, machine, sse_events, user_turn
from servers import ServerProc, check, default_model, free_port, llama_server_cmd, slotserve_cmd, stop_servers
from streams import BANNED


async def turn(client: httpx.AsyncClient, base: str, slot: int, ids: list[int], new: int) -> tuple[list[int], int]:
    """One streamed ``/completion`` of ``new`` tokens on ``id_slot`` ``slot``: the generated token ids, and the
    prompt tokens the server evaluated (the last event's ``timings.prompt_n``, llama-server's field; -1 if
    absent): what its cache did not hold."""
    body = {
        "prompt": ids,
        "n_predict": new,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": [[t, False] for t in BANNED],
        "id_slot": slot,
        "cache_prompt": True,
        "stream": True,
        "return_tokens": True,
    }
    out: list[int] = []
    evaluated = -1
    async with client.stream("POST", base + "/completion", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"{base}: HTTP {resp.status_code} {resp.text[:300]}")
        async for ev in sse_events(resp):
            if "error" in ev:
                raise RuntimeError(f"{base}: {ev}")
            out += ev.get("tokens") or []
            evaluated = int((ev.get("timings") or {}).get("prompt_n", evaluated))
    if len(out) != new:
        raise RuntimeError(f"{base}: {len(out)} tokens generated, asked {new}")
    return out, evaluated


async def run_turn(
    base: str, convs: list[list[int]], which: list[int], append: list[int], new: int
) -> tuple[float, list[int]]:
    """Turn of the conversations ``which`` at once (each extended in place): tok/s of the turn, and the prompt
    tokens each request evaluated (see :func:`turn`)."""
    async with httpx.AsyncClient(timeout=600) as client:
        prompts = {i: convs[i] + append for i in which}
        t0 = time.perf_counter()
        got = await asyncio.gather(*(turn(client, base, i, prompts[i], new) for i in which))
        dt = time.perf_counter() - t0
    for i, (gen, _) in zip(which, got, strict=True):
        convs[i] = prompts[i] + gen
    return len(which) * new / dt, [n for _, n in got]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (no llama rows without)")
    ap.add_argument(
        "--llama-args",
        action="append",
        default=None,
        help="extra llama-server arguments (e.g. '-fa off'); repeat to compare several llama-servers",
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1900, help="tokens per conversation before the first turn")
    ap.add_argument("--new", type=int, default=48, help="tokens generated per turn")
    ap.add_argument("--turns", type=int, default=5, help="measured turns per load")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=4096, help="context per slot")
    ap.add_argument("--pause", type=float, default=1.0, help="s before each timed turn (write-behinds settle)")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    model = args.model or default_model()
    tmp = Path(tempfile.mkdtemp(prefix="bench-turns-"))
    print(f"{machine()}; {model.name}; {args.convs} conversations of {args.prompt} tokens, {args.new}-token turns")
    print(f"load before: {load()}")
    servers: list[ServerProc] = []
    try:
        for name in ("strict", "write-behind"):
            port = free_port()
            cmd = slotserve_cmd(
                port, tmp / name, parallel=args.convs, ctx_size=args.ctx_size, threads=args.threads, spare=None,
                model=model, extra=["--durability", name],
            )  # fmt: skip
            servers.append(ServerProc(f"slotserve {name}", cmd, port, tmp / f"{name}.log"))
        llamas: list[str] = []
        for k, extra in enumerate((args.llama_args or [""]) if args.llama_server else []):
            port = free_port()
            cmd = llama_server_cmd(
                args.llama_server, model, port, parallel=args.convs, ctx_size=args.ctx_size, threads=args.threads,
                n_gpu_layers=0, slot_dir=tmp / f"llama-slots-{k}", extra=extra,
            )  # fmt: skip
            llamas.append("llama-server" + (f" {extra}" if extra else ""))
            servers.append(ServerProc(llamas[-1], cmd, port, tmp / f"llama-{k}.log"))
        for srv in servers:
            srv.wait_ready(httpx)
        with httpx.Client(timeout=60) as client:
            BANNED[:] = check(client.get(servers[0].base + "/api/v1/model"), "model info")["eog_token_ids"]
            tok = http_tokenizer(client, servers[0].base)
            prompts = [build_prompt(tok, args.prompt, variant=i + 1) for i in range(args.convs)]
            append = user_turn(tok, "Go on, please.")
        convs = {srv.name: [list(p) for p in prompts] for srv in servers}
        every = list(range(args.convs))
        for srv in servers:  # the untimed first turn: each conversation prefilled
            asyncio.run(run_turn(srv.base, convs[srv.name], every, [], args.new))
        rates: dict[tuple[str, int], list[float]] = {}
        evaluated: dict[str, list[int]] = {}
        for t in range(args.turns):
            for srv in servers:
                for which in ([0], every):
                    time.sleep(args.pause)  # the servers' write-behind saves of the turn before are done
                    tps, n = asyncio.run(run_turn(srv.base, convs[srv.name], which, append, args.new))
                    rates.setdefault((srv.name, len(which)), []).append(tps)
                    evaluated.setdefault(srv.name, []).extend(n)
            print(f"  turn {t + 1}/{args.turns} done ({load()})")
        ctx = len(convs[servers[0].name][0])
        print(f"\nload after: {load()}; context at the end: {ctx} tokens")
        print(f"{'server':24} {'x1 tok/s':>9} {'x' + str(args.convs) + ' tok/s':>9}   (medians of {args.turns} turns)")
        med = {k: statistics.median(v) for k, v in rates.items()}
        for srv in servers:
            ev = sorted(set(evaluated[srv.name]))
            print(f"{srv.name:24} {med[(srv.name, 1)]:9.1f} {med[(srv.name, args.convs)]:9.1f}"
                  f"   prompt tokens evaluated per request: {ev if len(ev) < 6 else (ev[0], ev[-1])}")  # fmt: skip
        for n in (1, args.convs):
            strict, behind = med[("slotserve strict", n)], med[("slotserve write-behind", n)]
            line = f"x{n}: strict / write-behind {strict / behind:.3f}"
            for name in llamas:
                llama = med[(name, n)]
                line += f"; strict / {name} {strict / llama:.3f}; write-behind / {name} {behind / llama:.3f}"
            print(line)
    finally:
        stop_servers(servers, tmp, args.keep_logs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
