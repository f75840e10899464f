"""A Halo-Weave-like pruning trace: time to first token and prefilled tokens, with and without cache reuse.

Halo Weave sends no slot id and re-sends its whole pruned context every turn. The trace: a
``--context``-token conversation; each of ``--turns`` turns removes three chunks of ``--chunk`` tokens from
its middle (at 30 %, 50 % and 70 % of its length), appends a 40-token user message, and generates
``--new`` tokens greedily with aggregated attention; the next turn's context is the pruned one, the
message and a fixed 32-token reply (so every server sees the same prompts whatever it generates).

Servers, one after the other, on the default model, with default flags:

- slotserve through ``POST /api/extra/generate/stream`` with ``input_ids`` and no slot id (KoboldCpp's route,
  Halo Weave's), ``--configs`` of: ``reprefill`` (``n_cache_reuse`` 0: an exact re-prefill from the first
  removed token, the other APIs' default), ``default`` (no ``n_cache_reuse`` in the body: KoboldCpp's routes'
  default, cache reuse as KoboldCpp's ContextShift) and ``reuse`` (``n_cache_reuse`` ``--reuse``);
- llama-server (``--llama-server``, built from the same llama.cpp) without and with ``--cache-reuse``
  ``--reuse``, through its ``POST /completion`` stream (token ids, ``cache_prompt``).

Printed per turn: time to first token (ms), tokens prefilled, tokens cached; then per server the totals and
the ratio to the full re-prefill, and per turn the ratio of each slotserve configuration's prefilled tokens to
what an exact re-prefill prefills (the prompt after its common prefix with the previous one, counted from the
trace). Fidelity of reuse (slotserve): per turn, the first generated token's
aggregated attention with reuse against without (correlation, mean abs diff) and whether the greedy
tokens agree.

    .venv/bin/python benchmarks/bench_cache_reuse.py --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import base64
import json
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from common import build_prompt, model_tokenizer, user_turn
from servers import (
    ServerProc,
    default_model,
    free_port,
    llama_server_cmd,
    slotserve_cmd,
)

MESSAGE = 40
REPLY = 32
TIMEOUT_S = 3600.0  # one turn's request: a 4,000-token prefill on a loaded 2-core machine can take minutes


def trace(tokenize, context: int, turns: int, chunk: int) -> tuple[list[int], list[list[int]]]:  # type: ignore[no-untyped-def]
    """The conversation before the first turn and the prompts of the turns (token ids; module docstring)."""
    ctx = build_prompt(tokenize, context)
    first = list(ctx)
    prompts = []
    reply = tokenize(" Noted: the parts above were read and the answer follows from them, briefly." * 3, False)
    for t in range(turns):
        n = len(ctx)
        for frac in (0.7, 0.5, 0.3):  # from the back, so earlier cuts keep their place
            at = int(n * frac)
            del ctx[at : at + chunk]
        msg = user_turn(tokenize, f"Question {t}: which part mentions the most numbers, and why? " * 4)[-MESSAGE:]
        ctx = ctx + msg
        prompts.append(list(ctx))
        ctx = ctx + reply[:REPLY]
    return first, prompts


def reprefill_counts(first: list[int], prompts: list[list[int]]) -> list[int]:
    """Per turn, what an exact re-prefill prefills: the prompt after its common prefix with the previous
    turn's prompt (the pruning starts inside the previous prompt, before anything generated)."""
    out = []
    for prev, cur in zip([first, *prompts], prompts, strict=False):
        n = 0
        while n < min(len(prev), len(cur)) and prev[n] == cur[n]:
            n += 1
        out.append(len(cur) - n)
    return out


def slotserve_turn(client: httpx.Client, base: str, ids: list[int], new: int, reuse: int | None) -> dict:  # type: ignore[type-arg]
    body = {"input_ids": ids, "max_new_tokens": new, "temperature": 0, "ignore_eos": True,
            "return_attention": True, "attention_format": "aggregated"}  # fmt: skip
    if reuse is not None:  # left out: the route's default (KoboldCpp's: reuse unless --noshift)
        body["n_cache_reuse"] = reuse
    t0 = time.perf_counter()
    ttft, tokens, first_att, done = None, [], None, {}
    with client.stream("POST", base + "/api/extra/generate/stream", json=body, timeout=TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if ev.get("type") == "token":
                ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1000
                tokens.append(ev["token"]["token_id"])
                if first_att is None:
                    first_att = np.frombuffer(base64.b64decode(ev["attention"]["data"]), dtype=np.float32)
            elif ev.get("type") == "done":
                done = ev
    return {"ttft": ttft, "cached": done["cached_tokens"], "prefilled": done["prompt_tokens"] - done["cached_tokens"],
            "tokens": tokens, "att": first_att}  # fmt: skip


def llama_turn(client: httpx.Client, base: str, ids: list[int], new: int) -> dict:  # type: ignore[type-arg]
    body = {"prompt": ids, "n_predict": new, "temperature": 0, "ignore_eos": True, "cache_prompt": True,
            "stream": True, "id_slot": 0}  # fmt: skip
    t0 = time.perf_counter()
    ttft, timings = None, {}
    # a connection per request: llama-server drops idle keep-alive connections after 5 s
    close = {"Connection": "close"}
    with client.stream("POST", base + "/completion", json=body, timeout=TIMEOUT_S, headers=close) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            ev = json.loads(line[5:])
            if ev.get("content") or ev.get("tokens"):
                ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1000
            if ev.get("stop"):
                timings = ev.get("timings", {})
    return {"ttft": ttft, "cached": timings.get("cache_n", 0), "prefilled": timings.get("prompt_n", 0)}


def run_server(
    name: str, cmd: list[str], port: int, tmp: Path, turn, first: list[int], prompts, new: int
) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    """Start the server, cache ``first`` (one token generated), run ``turn`` for each prompt, stop it; print
    each turn as it ends.  A server that fails mid-way: its log's tail is printed and its turns so far kept."""
    log = tmp / f"{name.replace(' ', '_')}.log"
    srv = ServerProc(name, cmd, port, log)
    rows: list[dict] = []  # type: ignore[type-arg]
    try:
        srv.wait_ready(httpx)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client() as client:
            turn(client, base, first, 1)
            for ids in prompts:
                rows.append(turn(client, base, ids, new))
                r = rows[-1]
                print(f"{name}: turn {len(rows) - 1} ttft {r['ttft']:.0f} ms, prefilled {r['prefilled']}, "
                      f"cached {r['cached']}", flush=True)  # fmt: skip
    except httpx.HTTPError as exc:
        print(f"{name} failed after {len(rows)} turns: {exc}\n{log.read_text(errors='replace')[-3000:]}", flush=True)
    finally:
        srv.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=150)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reuse", type=int, default=256, help="n_cache_reuse / --cache-reuse (tokens)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-slotserve", action="store_true", help="run llama-server's two configurations only")
    ap.add_argument("--configs", default="reprefill,default,reuse", help="slotserve configurations (docstring)")
    a = ap.parse_args()
    ctx_size = a.context + 1024
    model_path = default_model()
    from engine.model import Model

    model = Model(model_path)
    first, prompts = trace(model_tokenizer(model), a.context, a.turns, a.chunk)
    model.close()
    results: dict[str, list[dict]] = {}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        configs = {"reprefill": ("slotserve", 0), "default": ("slotserve Kobold default", None),
                   "reuse": (f"slotserve n_cache_reuse {a.reuse}", a.reuse)}  # fmt: skip
        ours = [configs[c.strip()] for c in a.configs.split(",") if c.strip()]
        for name, reuse in [] if a.skip_slotserve else ours:
            port = free_port()
            cmd = slotserve_cmd(port, tmp / name.replace(" ", "_"), parallel=1, ctx_size=ctx_size, threads=a.threads)

            def s_turn(client, base, ids, new, reuse=reuse):  # type: ignore[no-untyped-def]
                return slotserve_turn(client, base, ids, new, reuse)

            results[name] = run_server("slotserve", cmd, port, tmp, s_turn, first, prompts, a.new)
        if a.llama_server:
            for name, extra in (
                ("llama-server", ""),
                (f"llama-server --cache-reuse {a.reuse}", f"--cache-reuse {a.reuse}"),
            ):
                port = free_port()
                cmd = llama_server_cmd(a.llama_server, model_path, port, parallel=1, ctx_size=ctx_size,
                                       threads=a.threads, n_gpu_layers=0, slot_dir=tmp / "ls", extra=extra)  # fmt: skip
                results[name] = run_server("llama-server", cmd, port, tmp, llama_turn, first, prompts, a.new)
    print(
        f"trace: {a.context} tokens, {a.turns} turns, 3 x {a.chunk} tokens pruned per turn, {MESSAGE}-token "
        f"message, {a.new} new; --threads {a.threads}; per turn: ttft ms / prefilled / cached"
    )
    results = {name: rows for name, rows in results.items() if len(rows) == len(prompts)}
    for name, rows in results.items():
        cells = "  ".join(f"{r['ttft']:6.0f}/{r['prefilled']:4d}/{r['cached']:4d}" for r in rows)
        print(f"{name:<34} {cells}  | ttft {sum(r['ttft'] for r in rows):7.0f} ms, prefilled "
              f"{sum(r['prefilled'] for r in rows)}")  # fmt: skip
    for name in results:
        base = "llama-server" if name.startswith("llama-server") else "slotserve"
        if base not in results:
            continue
        ttft = sum(r["ttft"] for r in results[name]) / sum(r["ttft"] for r in results[base])
        pre = sum(r["prefilled"] for r in results[name]) / max(1, sum(r["prefilled"] for r in results[base]))
        print(f"{name:<34} / {base}: ttft {ttft:.3f}, prefilled tokens {pre:.3f}")
    exact = reprefill_counts(first, prompts)
    print("an exact re-prefill prefills per turn: " + " ".join(str(n) for n in exact))
    for name, rows in results.items():
        if name.startswith("slotserve"):
            ratios = [r["prefilled"] / n for r, n in zip(rows, exact, strict=True)]
            print(f"{name:<34} prefilled per turn / re-prefill's: " + " ".join(f"{x:.3f}" for x in ratios)
                  + f" (max {max(ratios):.3f})")  # fmt: skip
    off = results.get("slotserve", [])
    for name in (f"slotserve n_cache_reuse {a.reuse}", "slotserve Kobold default"):
        for k, (r1, r0) in enumerate(zip(results.get(name, []), off, strict=False)):
            corr = float(np.corrcoef(r1["att"], r0["att"])[0, 1])
            mad = float(np.abs(r1["att"] - r0["att"]).mean())
            agree = sum(x == y for x, y in zip(r1["tokens"], r0["tokens"], strict=False))
            print(
                f"fidelity {name}, turn {k}: first token's aggregated attention corr {corr:.4f}, mean abs diff "
                f"{mad:.2e}; greedy tokens equal {agree}/{len(r0['tokens'])}"
            )


if __name__ == "__main__":
    main()
