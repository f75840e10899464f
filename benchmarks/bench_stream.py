"""Streaming throughput: raw engine vs. capture vs. WebSocket binary vs. SSE base64.

Measures, in one run and on the same prompt (same ``input_ids``, greedy, ``ignore_eos``,
the same number of new tokens), the decode speed of

1. the in-process engine without attention capture (``EngineSettings(capture=False)``),
2. the in-process engine with capture and attention requested (no client),
3. a WebSocket client of ``/api/extra/generate/stream/ws`` receiving every token's full
   per-layer attention as a binary ``float32[L, H, ctx]`` frame (``websockets``),
   with the library's default permessage-deflate offer and with compression off,
4. an SSE client of ``POST /api/extra/generate/stream`` decoding every token's base64
   attention (``httpx`` streaming),

and prints medians and the ratios (the server's two clients are ``attention_streams.py``).
Decode speed is ``(n - 1) / (t_last - t_first)``
with ``t`` the moment each token is complete (in-process: emitted by the batcher;
clients: its attention received and decoded), so prefill is excluded and reported
separately (time to the first token).

The in-process engines (1, 2) run first, their reps interleaved, and are closed before
the server starts; the server's clients (3, 4) then take turns.  Nothing else of the
benchmark runs during a rep.  Each rep is preceded by a warm-up (rep 0, not counted);
server reps reuse slot 0's KV prefix (``cached`` column), which is the same for WS and SSE.

Per path the CPU time each process (client, orchestrator, worker) spends between the first
and last token is reported per token, and ``cores`` = all of it / decode wall time, which
shows where time goes.  On a shared machine other jobs distort everything (a 2-thread
llama.cpp decode slows down many times when a core is taken), so the load of processes
outside the benchmark is measured per rep (``other``) and a rep is redone while it exceeds
``--max-other`` cores.

    .venv/bin/python benchmarks/bench_stream.py [--ctx 500] [--new 64] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import common  # puts the checkout on sys.path, for the engine imports below
import llama_cpp  # noqa: F401 - llama.cpp before numpy (docs/hardware.md)
from attention_streams import Rep, sse_once, ws_once
from common import CpuMeter, Quiet, add_gpu_args, add_idle_args, model_tokenizer
from servers import ServerProc, free_port, settle, slotserve_cmd, stop_servers

from contract.heap import keep_heap_mapped
from contract.options import CaptureOptions, SamplingParams
from contract.protocol import Done, Error, Generate, Token
from contract.settings import EngineSettings
from engine.batcher import Batcher
from engine.engine import Engine
from engine.model import Model, default_model_path

SHM_BYTES = 128 << 20
"""``--shm on``: the region's size (docs/operations.md: ``--stream-window-bytes``, 16 MiB by default, times the
engine's sequences, at least 64 MiB)."""

# ----------------------------------------------------------------------------- results


@dataclass
class Phase:
    name: str
    reps: list[Rep] = field(default_factory=list)
    note: str = ""
    discarded: int = 0  # reps measured again because other processes were busy meanwhile

    def med(self, f) -> float:
        return statistics.median(f(r) for r in self.reps) if self.reps else float("nan")

    @property
    def tps(self) -> float:
        return self.med(lambda r: r.tps)


# ----------------------------------------------------------------------------- prompt


def build_prompt(model: Model, n: int) -> list[int]:
    """Exactly ``n`` token ids: a chat turn whose user message is cut to fit."""
    return common.build_prompt(model_tokenizer(model), n)


# ----------------------------------------------------------------------------- one measured rep


def take_rep(
    phase: Phase, r: int, fn: Callable[[], Rep], quiet: Quiet, before: Callable[[], None] | None = None
) -> None:
    """Run ``fn`` once on an idle machine (rep 0: a warm-up, not kept), through :meth:`Quiet.run`,
    which measures it again while other processes were busy (counted in the phase's ``redo``)."""
    if before is not None:
        before()
    redone = quiet.redone
    rep, cpu = quiet.run(fn, label=f"{phase.name} rep {r}", warm=r == 0)
    rep.cpu = cpu
    phase.discarded += quiet.redone - redone
    extra = (
        f"prefill {rep.t_prefill * 1000:7.1f} ms"
        if rep.cached is None
        else f"ttft {rep.t_prefill * 1000:6.1f} ms, cached {rep.cached}"
    )
    tag = " (warm-up)" if r == 0 else ""
    print(f"  {phase.name} rep {r}{tag}: {rep.tps:7.1f} tok/s, {extra}, other load {rep.cpu['other']:.2f} cores")
    if r:
        phase.reps.append(rep)


# ----------------------------------------------------------------------------- in-process engine


def inproc_once(eng: Engine, ids: list[int], args: argparse.Namespace, meter: CpuMeter) -> Rep:
    """One generation on sequence 0 of an in-process engine, prompt prefilled from scratch."""
    capture = eng.config.capture
    shape = (eng.model.n_layer, eng.model.n_head)
    eng.erase(0)  # the whole prompt is prefilled again each time
    events: list[tuple[float, object]] = []
    bad: list[str] = []

    def emit(msg: object, bufs: object) -> None:
        t = time.perf_counter()
        events.append((t, msg))
        if isinstance(msg, Token) and msg.index in (0, args.new - 1):
            meter.mark("first" if msg.index == 0 else "last")
        if isinstance(msg, Token) and capture:
            want = (*shape, len(ids) + msg.index)
            if msg.attention is None or msg.attention.shape != want:
                bad.append(f"token {msg.index}: attention {msg.attention} is not of shape {want}")

    b = Batcher(eng, emit)
    params = SamplingParams(max_new_tokens=args.new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    b.submit(Generate(1, 0, "generate", ids, params, CaptureOptions(attention=capture)))
    while b.has_work():
        b.step()
    errs = [m for _, m in events if isinstance(m, Error)]
    if errs:
        raise RuntimeError(f"in-process: {errs[0]}")
    if bad:
        raise RuntimeError(f"in-process: {bad[0]}")
    toks = [(t, m) for t, m in events if isinstance(m, Token)]
    assert any(isinstance(m, Done) for _, m in events)
    return Rep(
        n=len(toks),
        t_prefill=toks[0][0] - t0,
        t_decode=toks[-1][0] - toks[0][0],
        tokens=[m.token_id for _, m in toks],  # type: ignore[attr-defined]
        gaps=common.token_gaps(t for t, _ in toks),
    )


def bench_inproc(model: Model, ids: list[int], args: argparse.Namespace) -> tuple[Phase, Phase]:
    """Raw engine (no eval callback) and engine + capture, reps interleaved so drift hits both alike;
    the worker's heap settings (``contract/heap.py``)."""
    keep_heap_mapped()
    paths: list[tuple[Phase, Engine]] = []
    quiet = Quiet(args)
    try:
        for capture, name in ((False, "raw engine (no capture)"), (True, "engine + capture (no client)")):
            cfg = EngineSettings(
                n_ctx=args.n_ctx, n_slots=1, n_spare=args.spare, n_threads=args.threads, capture=capture
            )
            paths.append((Phase(name), Engine(model, cfg)))
        for r in range(args.reps + 1):  # rep 0 is a warm-up
            for phase, eng in paths:
                take_rep(phase, r, lambda eng=eng: inproc_once(eng, ids, args, quiet.meter), quiet)
    finally:
        for _, eng in paths:
            eng.close()
    return paths[0][0], paths[1][0]


# ----------------------------------------------------------------------------- server


def bench_server(
    ids: list[int], args: argparse.Namespace, shape: tuple[int, int], extra: list[str], suffix: str = ""
) -> list[Phase]:
    """The server's paths, ``extra`` flags given to ``slotserve serve``, ``suffix`` added to each path's name."""
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    port = free_port()
    cmd = slotserve_cmd(
        port,
        tmp / "state",
        parallel=1,
        ctx_size=args.n_ctx,
        threads=args.threads,
        spare=args.spare,
        model=args.model,
        n_gpu_layers=args.n_gpu_layers,
        extra=extra,
    )
    srv = ServerProc("orchestrator", cmd, port, tmp / "server.log")
    ws_url = f"ws://127.0.0.1:{srv.port}/api/extra/generate/stream/ws"
    sse_url = srv.base + "/api/extra/generate/stream"
    ws_modes = ["default", "none"] if args.ws_compression == "both" else [args.ws_compression]
    label = {"default": "WS binary (deflate offered)", "none": "WS binary (no compression)"}
    phases = {f"ws:{m}": Phase(label[m] + suffix) for m in ws_modes}
    phases["sse"] = Phase("SSE base64" + suffix)
    try:
        up = srv.wait_ready(httpx)
        print(f"  server up on :{srv.port} in {up:.1f}s (worker pid {srv.worker_pid})")
        pids = {"orchestrator": srv.proc.pid}
        if srv.worker_pid:
            pids["worker"] = srv.worker_pid
        quiet = Quiet(args, pids)
        meter = quiet.meter
        with httpx.Client(timeout=None) as client:
            for r in range(args.reps + 1):  # rep 0 is a warm-up of every path (the first one prefills fully)
                for key, phase in phases.items():
                    if key.startswith("ws:"):

                        def once(mode: str = key[3:], phase: Phase = phase) -> Rep:
                            rep = asyncio.run(ws_once(ws_url, ids, args.new, shape, mode, meter))
                            phase.note = f"Sec-WebSocket-Extensions: {rep.ext}"
                            return rep
                    else:

                        def once() -> Rep:
                            return sse_once(client, sse_url, ids, args.new, shape, meter)

                    take_rep(phase, r, once, quiet, before=lambda: settle(client, srv.base, slots=["0"]))
    finally:
        stop_servers([srv], tmp, args.keep_log)
    return list(phases.values())


# ----------------------------------------------------------------------------- report


def report(args: argparse.Namespace, ids: list[int], raw: Phase, cap: Phase, server: list[Phase]) -> None:
    phases = [raw, cap, *server]
    print()
    print(
        f"prompt {len(ids)} tokens, {args.new} new tokens (greedy, ignore_eos), {args.reps} reps (median), "
        f"threads {args.threads}, n_ctx {args.n_ctx}, spare {args.spare}, cpus {os.cpu_count()}"
    )
    print()
    hdr = f"{'path':30} {'decode tok/s':>12} {'min..max':>15} {'ttft ms':>8} {'cached':>6} {'other':>5} {'redo':>4}"
    hdr += "   decode CPU ms/token: client / orch / worker = cores"
    print(hdr)
    print("-" * len(hdr))
    for p in phases:
        tps = [r.tps for r in p.reps]
        cached = p.reps[0].cached if p.reps else None

        def per_tok(k: str, p: Phase = p) -> str:
            if not p.reps or "decode:" + k not in p.reps[0].cpu:
                return "-"
            return f"{statistics.median(rep.cpu['decode:' + k] / (rep.n - 1) * 1000 for rep in p.reps):.1f}"

        def cores(rep: Rep) -> float:
            return sum(v for k, v in rep.cpu.items() if k.startswith("decode:")) / rep.t_decode

        cpu = " / ".join(per_tok(k) for k in ("client", "orchestrator", "worker"))
        cpu += f" = {p.med(cores):.2f}"
        print(
            f"{p.name:30} {p.tps:12.1f} {min(tps):7.1f}..{max(tps):<7.1f} {p.med(lambda r: r.t_prefill) * 1000:8.1f} "
            f"{'-' if cached is None else cached:>6} {p.med(lambda r: r.cpu['other']):5.2f} {p.discarded:4}   {cpu}"
        )
    print()
    for p in server:
        if p.note:
            print(f"{p.name}: {p.note}")
    ref = raw.reps[0].tokens if raw.reps else []
    same = all(r.tokens == ref for p in phases for r in p.reps)
    print(f"identical token ids on every path and rep: {same}")
    for p in phases:  # where a path's greedy tokens leave the raw engine's (the first rep that does)
        for k, r in enumerate(p.reps):
            if r.tokens != ref:
                first = next((i for i, (a, b) in enumerate(zip(r.tokens, ref, strict=False)) if a != b), None)
                where = f"token {first}" if first is not None else f"length {len(r.tokens)} vs {len(ref)}"
                print(f"  {p.name}, rep {k}: differs from the raw engine's first rep at {where}")
                break
    worst = max(r.cpu["other"] for p in phases for r in p.reps)
    print(
        "'other' = cores used by processes outside this benchmark during a rep (median), "
        "'redo' = reps measured again because of it; "
        f"worst rep {worst:.2f}" + ("  <-- WARNING: machine shared, figures distorted" if worst > 0.2 else "")
    )
    print()
    print("ratios (median decode tok/s):")
    print(f"  capture / raw            {cap.tps / raw.tps:6.3f}")
    for p in server:
        if p.name.startswith("WS"):
            print(f"  {p.name + ' / raw':38} {p.tps / raw.tps:6.3f}")
    sse = next(p for p in server if p.name.startswith("SSE"))
    print(f"  {'SSE / raw':38} {sse.tps / raw.tps:6.3f}")
    for p in server:
        if p.name.startswith("WS"):
            print(f"  {p.name + ' / SSE':38} {p.tps / sse.tps:6.3f}")
    by_name = {p.name: p for p in server}
    for p in server:  # --shm both: the same path through the shared region and through the socket
        other = by_name.get(p.name.replace(" [shm]", " [socket]"))
        if other is not None and other is not p and p.reps and other.reps:
            print(f"  {p.name + ' / [socket]':38} {p.tps / other.tps:6.3f}")
    ws = [p for p in server if p.name.startswith("WS")]
    best = max(ws, key=lambda p: p.tps)
    goal = ws[0].tps / raw.tps
    print()
    print(
        f"goal WS-with-attention >= 0.85 x raw: {ws[0].name}: {goal:.3f} -> {'MET' if goal >= 0.85 else 'NOT MET'}"
        + (f"; best WS ({best.name}): {best.tps / raw.tps:.3f}" if best is not ws[0] else "")
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=500, help="prompt length (tokens)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions per path (+1 warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (engine and server worker)")
    ap.add_argument("--n-ctx", type=int, default=4096, help="context window per slot")
    ap.add_argument("--spare", type=int, default=1, help="spare sequences (engine and server, kept equal)")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument(
        "--ws-compression",
        choices=["default", "none", "both"],
        default="both",
        help="websockets client: default (offers permessage-deflate, like browsers), none, or both",
    )
    ap.add_argument(
        "--shm",
        choices=["on", "off", "both"],
        default="on",
        help=f"the worker's tensors through a shared region (--stream-shm-bytes {SHM_BYTES}), its socket (the"
        " server's default, --stream-shm-bytes 0), or both, one server after the other",
    )
    add_gpu_args(ap)
    add_idle_args(ap)
    ap.add_argument("--keep-log", action="store_true", help="keep the server log")
    args = ap.parse_args()
    if args.new < 2:
        ap.error("--new must be >= 2")

    model = Model(args.model or default_model_path(), n_gpu_layers=args.n_gpu_layers)
    ids = build_prompt(model, args.ctx)
    print(f"model {model.path.name}, layers {model.n_layer}, heads {model.n_head}, prompt {len(ids)} tokens")
    print("[1/2] in-process engine: capture off / on (interleaved)")
    raw, cap = bench_inproc(model, ids, args)
    shape = (model.n_layer, model.n_head)
    model.close()
    del model
    print("[2/2] server: WS and SSE clients (interleaved)")
    server = []
    if args.shm in ("on", "both"):
        server += bench_server(ids, args, shape, ["--stream-shm-bytes", str(SHM_BYTES)], " [shm]")
    if args.shm in ("off", "both"):
        server += bench_server(ids, args, shape, ["--stream-shm-bytes", "0"], " [socket]")
    report(args, ids, raw, cap, server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
