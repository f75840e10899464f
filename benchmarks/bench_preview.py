"""Preview vs. from scratch: the cost of a copy-on-write preview of a long slot.

For each context size (``--sizes``, default 500, 1500, 3000 tokens), on one ``slotserve serve
--ctx-size 4096``:

1. a slot is filled with exactly that many tokens (a conversation ending after an assistant turn;
   ``POST /api/v1/generate`` with ``max_new_tokens: 0``);
2. **preview**: ``POST /api/v1/generate/preview`` on that slot, appending ``--append`` tokens (a user
   turn and the assistant header), ``max_tokens`` ``--new``, temperature 0;
3. **scratch**: the same context (slot tokens + the appended ones) on a fresh slot,
   ``POST /api/v1/generate``, ``max_new_tokens`` ``--new``, temperature 0 (both stop at an end of
   generation token, a preview always does), then the fresh slot is erased (not timed);
4. optionally (``--empty-scratch``, on by default) **scratch, cache empty**: the same, before the
   slot of step 1 exists (with a KV stream per sequence the resident slot should cost the scratch run
   nothing; the column shows whether it does).

Preview and scratch reps alternate (``--reps`` previews after a warm-up, ``--scratch-reps`` scratch
runs: they take tens of seconds; the server is warmed up once at the start), each after an
idle-machine wait and redone if other processes were busy (``--wait-idle`` / ``--max-other``); times
are the client's request round trips, medians. The
ratio preview / scratch is the figure of merit (goal: < 0.25 at 1500 tokens, falling with size).
The server's own ``generation_time_ms`` and the preview's ``n_prefilled`` / ``n_cached`` /
``cache_hit`` are shown too.

    .venv/bin/python benchmarks/bench_preview.py [--sizes 500,1500,3000] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import Quiet, Tokenize, add_gpu_args, add_idle_args, build_prompt, http_tokenizer, median
from servers import ServerProc, check, default_model, free_port, settle, slotserve_cmd, stop_servers

REPLY = "Here is a short summary: lighthouses guided ships, and their keepers kept the lights burning.<|im_end|>\n"
QUESTION = "Now tell me more about the keepers and their daily work at the lighthouse, please."


def context(tok: Tokenize, n: int) -> list[int]:
    """Exactly ``n`` tokens: a user turn, then an assistant reply that ends the turn."""
    reply = tok(REPLY, True)
    return build_prompt(tok, n - len(reply)) + reply


def user_append(tok: Tokenize, n: int) -> list[int]:
    """Exactly ``n`` tokens: a user turn (its text cut to fit) and the assistant header."""
    head = tok("<|im_start|>user\n", True)
    tail = tok("<|im_end|>\n<|im_start|>assistant\n", True)
    body = tok(QUESTION, False)
    while len(head) + len(body) + len(tail) < n:
        body += tok(" " + QUESTION, False)
    out = head + body[: n - len(head) - len(tail)] + tail
    if len(out) != n:
        raise ValueError(f"cannot build a {n}-token user turn (head + tail alone are {len(head) + len(tail)})")
    return out


@dataclass
class Sample:
    wall: float  # s, client round trip
    server_ms: float  # generation_time_ms
    n_gen: int
    tokens: list[int]
    n_prefilled: int | None = None
    n_cached: int | None = None
    cache_hit: bool | None = None


def generate_sample(client: httpx.Client, base: str, slot: str, ids: list[int], new: int) -> Sample:
    """``POST /api/v1/generate`` of ``ids`` on ``slot`` (greedy, ``new`` tokens at most), timed by the client."""
    body = {"input_ids": ids, "max_new_tokens": new, "temperature": 0, "id_slot": slot, "wait": True}
    t0 = time.perf_counter()
    d = check(client.post(base + "/api/v1/generate", json=body), f"generate on {slot}")
    wall = time.perf_counter() - t0
    toks = [t["token_id"] for t in d.get("generated_tokens", [])]
    cached = d.get("cached_tokens")
    return Sample(wall, d["generation_time_ms"], len(toks), toks, d["prompt_tokens"] - cached, cached, None)


def preview_sample(client: httpx.Client, base: str, slot: str, append: list[int], new: int) -> Sample:
    """``POST /api/v1/generate/preview`` of ``slot`` with ``append`` (greedy, ``new`` tokens at most), timed."""
    body = {"id_slot": slot, "append_tokens": append, "max_tokens": new, "temperature": 0}
    t0 = time.perf_counter()
    d = check(client.post(base + "/api/v1/generate/preview", json=body), f"preview of {slot}")
    wall = time.perf_counter() - t0
    toks = [t["token_id"] for t in d["tokens"]]
    n, hit = d["token_count"], d["cache_hit"]
    return Sample(wall, d["generation_time_ms"], n, toks, d["n_prefilled"], d["n_cached"], hit)


@dataclass
class Size:
    n: int
    fill_s: float = 0.0
    preview: list[Sample] = field(default_factory=list)
    scratch: list[Sample] = field(default_factory=list)
    empty: list[Sample] = field(default_factory=list)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="500,1500,3000", help="slot sizes (tokens)")
    ap.add_argument("--append", type=int, default=15, help="tokens the preview appends")
    ap.add_argument("--new", type=int, default=50, help="tokens to generate")
    ap.add_argument("--reps", type=int, default=3, help="measured previews (+1 warm-up)")
    ap.add_argument("--scratch-reps", type=int, default=2, help="measured scratch runs (long: tens of seconds)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--spare", type=int, default=1)
    ap.add_argument("--no-empty-scratch", dest="empty_scratch", action="store_false", help="skip step 4")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--keep-logs", action="store_true")
    add_gpu_args(ap)
    add_idle_args(ap)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if max(sizes) + args.append + args.new > args.ctx_size:
        ap.error("largest size + append + new exceeds --ctx-size")

    tmp = Path(tempfile.mkdtemp(prefix="bench-preview-"))
    port = free_port()
    cmd = slotserve_cmd(
        port, tmp / "state", parallel=args.parallel, ctx_size=args.ctx_size, threads=args.threads,
        spare=args.spare, model=args.model or default_model(), n_gpu_layers=args.n_gpu_layers,
    )  # fmt: skip
    srv = ServerProc("slotserve", cmd, port, tmp / "slotserve.log")
    results: list[Size] = []
    try:
        print(f"slotserve ready on :{port} in {srv.wait_ready(httpx):.1f}s", flush=True)
        client = httpx.Client(timeout=None)
        base = srv.base
        tok = http_tokenizer(client, base)
        append = user_append(tok, args.append)
        quiet = Quiet(args, srv.pids())

        def generate(slot: str, ids: list[int], new: int) -> Sample:
            return generate_sample(client, base, slot, ids, new)

        def preview(slot: str) -> Sample:
            return preview_sample(client, base, slot, append, args.new)

        def erase(slot: str) -> None:
            check(client.post(f"{base}/slots/{slot}", params={"action": "erase", "wait": "true"}), f"erase {slot}")

        # warm the server up once (first decodes, allocations); nothing measured
        generate("warm-up", build_prompt(tok, 64), 8)
        erase("warm-up")
        for n in sizes:
            size = Size(n)
            results.append(size)
            ctx = context(tok, n)
            full = ctx + append
            print(f"[{n} tokens] context {len(ctx)} + {len(append)} appended", flush=True)
            if args.empty_scratch:
                for r in range(1, args.scratch_reps + 1):
                    slot = f"empty-{n}-{r}"
                    settle(client, base)
                    s, cpu = quiet.run(lambda slot=slot, full=full: generate(slot, full, args.new), "scratch (empty)")
                    erase(slot)
                    print(f"  rep {r} scratch, cache empty: {s.wall * 1000:8.1f} ms, other {cpu['other']:.2f}")
                    size.empty.append(s)
            slot = f"pv-{n}"
            settle(client, base)
            fill, _ = quiet.run(lambda slot=slot, ctx=ctx: generate(slot, ctx, 0), "fill")
            size.fill_s = fill.wall
            print(f"  slot {slot} filled with {n} tokens (prefill only) in {fill.wall * 1000:.1f} ms", flush=True)
            for r in range(max(args.reps, args.scratch_reps) + 1):
                warm = r == 0
                line = f"  rep {r}{' (warm-up)' if warm else ''}:"
                if r <= args.reps:
                    settle(client, base)
                    p, pc = quiet.run(lambda slot=slot: preview(slot), "preview", warm)
                    line += (
                        f" preview {p.wall * 1000:7.1f} ms (prefilled {p.n_prefilled}, cached {p.n_cached}, "
                        f"hit {p.cache_hit}, {p.n_gen} tokens, other {pc['other']:.2f})"
                    )
                    if not warm:
                        size.preview.append(p)
                if 1 <= r <= args.scratch_reps:  # the server is warm: no warm-up needed for long requests
                    settle(client, base)
                    scratch_slot = f"scratch-{n}-{r}"
                    s, sc = quiet.run(lambda s_=scratch_slot, f_=full: generate(s_, f_, args.new), "scratch")
                    erase(scratch_slot)
                    line += (
                        f" scratch {s.wall * 1000:7.1f} ms (prefilled {s.n_prefilled}, {s.n_gen} tokens, "
                        f"other {sc['other']:.2f})"
                    )
                    size.scratch.append(s)
                print(line, flush=True)
            erase(slot)

        # ------------------------------------------------------------------ report
        print()
        print(
            f"model {Path(cmd[cmd.index('--model') + 1]).name}, --ctx-size {args.ctx_size}, --parallel "
            f"{args.parallel}, --spare {args.spare}, threads {args.threads}, cpus {os.cpu_count()}; "
            f"append {args.append} tokens, generate up to {args.new} (temperature 0); median of {args.reps} "
            f"previews, {args.scratch_reps} scratch runs; times are client round trips (server "
            "generation_time_ms in brackets)"
        )
        print()
        hdr = (
            f"{'slot':>5} {'fill ms':>8} {'preview ms':>16} {'prefilled':>9} {'cached':>6} {'hit':>5} {'gen':>4} "
            f"{'scratch ms':>17} {'prefilled':>9} {'gen':>4} {'ratio':>6}"
        )
        if args.empty_scratch:
            hdr += f" {'empty-cache ms':>17} {'ratio':>6}"
        print(hdr)
        print("-" * len(hdr))
        for sz in results:
            pw = median(x.wall for x in sz.preview)
            sw = median(x.wall for x in sz.scratch)
            p0, s0 = sz.preview[0], sz.scratch[0]
            line = (
                f"{sz.n:5} {sz.fill_s * 1000:8.1f} {pw * 1000:7.1f} [{median(x.server_ms for x in sz.preview):6.1f}] "
                f"{p0.n_prefilled:9} {p0.n_cached:6} {p0.cache_hit!s:>5} {p0.n_gen:4} "
                f"{sw * 1000:7.1f} [{median(x.server_ms for x in sz.scratch):7.1f}] {s0.n_prefilled:9} {s0.n_gen:4} "
                f"{pw / sw:6.3f}"
            )
            if sz.empty:
                ew = median(x.wall for x in sz.empty)
                line += f" {ew * 1000:7.1f} [{median(x.server_ms for x in sz.empty):7.1f}] {pw / ew:6.3f}"
            print(line)
        print()
        ref = {sz.n: sz.scratch[0].tokens for sz in results}
        runs = [(sz.n, x.tokens) for sz in results for x in sz.preview + sz.scratch[1:] + sz.empty]
        diverge = [next((i for i, (a, b) in enumerate(zip(t, ref[n], strict=False)) if a != b), None) for n, t in runs]
        same = sum(d is None and len(t) == len(ref[n]) for d, (n, t) in zip(diverge, runs, strict=True))
        firsts = sorted({d for d in diverge if d is not None})
        print(
            f"generated tokens identical to the first scratch run: {same}/{len(runs)} runs"
            + (
                f" (others diverge at token {', '.join(map(str, firsts))}: near-ties, cells at other places)"
                if firsts
                else ""
            )
        )
        by_n = {sz.n: median(x.wall for x in sz.preview) / median(x.wall for x in sz.scratch) for sz in results}
        if 1500 in by_n:
            print(f"goal ratio < 0.25 at 1500 tokens: {by_n[1500]:.3f} -> {'MET' if by_n[1500] < 0.25 else 'NOT MET'}")
        ordered = [by_n[n] for n in sorted(by_n)]
        falling = all(b < a for a, b in itertools.pairwise(ordered))
        print(f"ratio falling as the context grows: {falling} ({', '.join(f'{r:.3f}' for r in ordered)})")
        print(quiet.summary())
    finally:
        stop_servers([srv], tmp, args.keep_logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
