"""Concurrent slots: aggregate decode throughput for 1, 2 and 4 streams, slotserve vs llama-server.

One ``slotserve serve --parallel 4`` (and, with ``--llama-server PATH``, a ``llama-server -np 4`` built
from the same llama.cpp) run side by side. For each stream count N, N clients start together, each on
its own slot (``id_slot`` 0..N-1) with its own prompt (different from the first tokens on), greedy,
``ignore_eos``, ``--new`` tokens. Paths:

- ``slotserve SSE``: ``POST /api/extra/generate/stream``, no attention (KoboldCpp token events);
- ``slotserve WS+attn``: ``WS /api/extra/generate/stream/ws``, every token's full per-layer float32
  attention as a binary frame (a token counts once its binary frame arrived);
- ``llama-server``: ``POST /completion`` with the prompt as token ids, ``stream``, ``id_slot``,
  ``cache_prompt``, ``n_predict``, ``temperature: 0``, ``ignore_eos`` (one llama-server per
  ``--llama-args``, e.g. ``--llama-args "" --llama-args "-kvu"``: llama-server with a unified KV cache,
  which makes every token attend over every resident slot's cells).

llama-server's ``ignore_eos`` bans the end-of-generation tokens (logit bias -inf), slotserve's only
keeps going after one, so slotserve requests also send them as ``banned_tokens``: the same load.

Loads: 1, 2 and 4 streams (``--streams``); "1" runs with the other slots erased, and "1+" once more
after the 4-stream load, while the other slots still hold their conversations (each in a KV stream of its
own, so they should cost the one stream no attention work). The scaling
ratio is x4 / x1 (alone).

Every path streams, and tok/s is measured the same way for all of them: the client timestamps each
token, and the aggregate decode rate is the number of tokens received in the window where *all* N
streams are decoding (from the last stream's first token to the first stream's last token), divided
by its length. For N = 1 that is ``(n - 1) / (t_last - t_first)``. Prefill is excluded (rep 0 is a
warm-up that prefills; later reps reuse each slot's prompt from its cache, on both servers), the time
to the first token is reported separately.

Reps are interleaved (rep r of every path and N, then rep r + 1), each waits for an idle machine
(``--wait-idle``) and is measured again while other processes used more than ``--max-other`` cores.
``cores`` is the CPU time of the client + servers during the window / its length.

    .venv/bin/python benchmarks/bench_slots.py [--llama-server /tmp/llama-build/bin/llama-server]
        [--prompt 100] [--new 128] [--reps 3] [--threads 2] [--ctx-size 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import (
    Quiet,
    add_gpu_args,
    add_idle_args,
    build_prompt,
    http_tokenizer,
    median,
    prefix_len,
)
from progress import progress_bar
from servers import ServerProc, default_model, free_port, llama_server_cmd, settle, slotserve_cmd, stop_servers
from streams import (
    Run,
    measure_streams,
    model_shape,
)

# ----------------------------------------------------------------------------- driver


@dataclass
class Series:
    name: str
    kind: str  # "sse", "ws" or "llama"
    server: ServerProc
    runs: dict[str, list[Run]] = field(default_factory=dict)
    cpu: dict[str, list[dict[str, float]]] = field(default_factory=dict)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary to compare with")
    ap.add_argument(
        "--llama-args",
        action="append",
        default=None,
        help="extra llama-server arguments (e.g. '-fa off -kvu'); repeat to compare several llama-servers",
    )
    ap.add_argument("--model", type=Path, default=None)
    add_gpu_args(ap)
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens per stream")
    ap.add_argument("--new", type=int, default=128, help="new tokens per stream")
    ap.add_argument("--streams", default="1,2,4", help="stream counts")
    ap.add_argument("--reps", type=int, default=3, help="measured reps (+1 warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--spare", type=int, default=1, help="slotserve --spare")
    ap.add_argument("--ctx-size", type=int, default=1024, help="context per slot (llama-server: -c parallel x this)")
    ap.add_argument("--no-attention", action="store_true", help="skip the WS + attention path")
    ap.add_argument("--keep-logs", action="store_true")
    add_idle_args(ap)
    args = ap.parse_args()
    counts = [int(x) for x in args.streams.split(",")]
    if max(counts) > args.parallel:
        ap.error("more streams than slots")
    if args.new < 2:
        ap.error("--new must be >= 2")
    model = args.model or default_model()

    tmp = Path(tempfile.mkdtemp(prefix="bench-slots-"))
    servers: list[ServerProc] = []
    try:
        port = free_port()
        cmd = slotserve_cmd(
            port, tmp / "state", parallel=args.parallel, ctx_size=args.ctx_size, threads=args.threads,
            spare=args.spare, model=model, n_gpu_layers=args.n_gpu_layers,
        )  # fmt: skip
        ss = ServerProc("slotserve", cmd, port, tmp / "slotserve.log")
        servers.append(ss)
        llamas: list[tuple[str, ServerProc]] = []
        for k, extra in enumerate((args.llama_args or [""]) if args.llama_server else []):
            lport = free_port()
            lcmd = llama_server_cmd(
                args.llama_server, model, lport, parallel=args.parallel, ctx_size=args.ctx_size,
                threads=args.threads, n_gpu_layers=args.n_gpu_layers, slot_dir=tmp / f"llama-slots-{k}", extra=extra,
            )  # fmt: skip
            name = "llama-server" + (f"#{k + 1}" if k else "")
            llamas.append((extra, ServerProc(name, lcmd, lport, tmp / f"llama-server-{k + 1}.log")))
            servers.append(llamas[-1][1])
        for srv in servers:
            print(f"{srv.name} ready on :{srv.port} in {srv.wait_ready(httpx):.1f}s", flush=True)

        sync = httpx.Client(timeout=None)
        shape = model_shape(sync, ss.base)
        tok = http_tokenizer(sync, ss.base)
        prompts = [build_prompt(tok, args.prompt, variant=i + 1) for i in range(max(counts))]
        pids: dict[str, int] = {}
        for srv in servers:
            pids |= srv.pids()
        quiet = Quiet(args, pids)

        paths = [Series("slotserve SSE (no attention)", "sse", ss)]
        if not args.no_attention:
            paths.append(Series("slotserve WS + attention", "ws", ss))
        for extra, ls in llamas:
            paths.append(Series(f"llama-server {extra}".strip(), "llama", ls))

        print(
            f"{len(prompts)} prompts of {args.prompt} tokens, {args.new} new tokens each, greedy, ignore_eos; "
            f"{args.reps} reps + warm-up, interleaved",
            flush=True,
        )
        # loads: (label, streams, erase the other slots first). "1" runs alone (the other slots erased);
        # "1+" runs after the largest load, with the other slots still holding their conversations
        loads = [(str(n), n, n == 1) for n in counts]
        if 1 in counts and max(counts) > 1:
            loads.append(("1+", 1, False))
        texts: dict[tuple[str, str, int], str] = {}
        bar = progress_bar()
        bar.start()
        runs_task = bar.add_task("runs", total=(args.reps + 1) * len(paths) * len(loads))
        for r in range(args.reps + 1):
            warm = r == 0
            for path in paths:
                for label, n, alone in loads:
                    bar.update(runs_task, advance=1, description=f"rep {r}/{args.reps} {path.name} x{label}")
                    if alone:
                        for i in range(1, args.parallel):
                            e = sync.post(f"{path.server.base}/slots/{i}", params={"action": "erase"})
                            if e.status_code not in (200, 404):  # 404: slotserve slot that does not exist
                                raise RuntimeError(f"{path.name}: erase slot {i}: HTTP {e.status_code} {e.text[:200]}")
                    if path.kind != "llama":
                        settle(sync, ss.base)  # write-behind saves of the previous run are done
                    run, cpu = measure_streams(
                        quiet, path.kind, path.server.base, prompts, n, args.new, shape, f"{path.name} x{label}", warm
                    )
                    for i, s in enumerate(run.streams):
                        texts.setdefault((path.name, label, i), "".join(s.text))
                    tag = " (warm-up)" if warm else ""
                    print(
                        f"  rep {r}{tag} {path.name:30} x{label:2}: {run.tps:7.1f} tok/s, "
                        f"ttft {run.ttft * 1000:6.1f} ms, cached {[s.cached for s in run.streams]}, "
                        f"other {cpu['other']:.2f}",
                        flush=True,
                    )
                    if not warm:
                        path.runs.setdefault(label, []).append(run)
                        path.cpu.setdefault(label, []).append(cpu)
        bar.stop()

        # ------------------------------------------------------------------ report
        print()
        print(
            f"model {model.name}, prompt {args.prompt} tokens/stream (distinct), {args.new} new tokens/stream, "
            f"threads {args.threads}, {args.parallel} slots x ctx {args.ctx_size}, cpus {os.cpu_count()}; "
            f"median of {args.reps} reps"
        )
        for _, ls in llamas:
            print(f"{ls.name}: {' '.join(ls.cmd[1:])}")
        print()
        hdr = f"{'path':30} {'streams':>7} {'agg tok/s':>9} {'min..max':>15} {'per stream':>10} {'wall tok/s':>10} "
        hdr += f"{'ttft ms':>8} {'cores':>5}  CPU ms/token: client / server (slotserve: orchestrator + worker)"
        print(hdr)
        print("-" * len(hdr))
        for path in paths:
            for label, n, _ in loads:
                runs, cpus = path.runs[label], path.cpu[label]
                tps = [x.tps for x in runs]

                def cores(rc: tuple[Run, dict[str, float]]) -> float:
                    run, cpu = rc
                    a, b = run.window
                    return sum(v for k, v in cpu.items() if k.startswith("decode:")) / (b - a)

                def ms_tok(keys: tuple[str, ...], runs: list[Run] = runs, cpus: list[dict] = cpus) -> float:
                    vals = []
                    for run, cpu in zip(runs, cpus, strict=True):
                        a, b = run.window
                        n_tok = run.tps * (b - a)
                        vals.append(sum(v for k, v in cpu.items() if k.startswith("decode:") and k[7:] in keys) / n_tok)
                    return median(vals) * 1000

                core = median(map(cores, zip(runs, cpus, strict=True)))
                srv_keys = [k for k in pids if k == path.server.name or k.startswith(path.server.name + ":")]
                per_proc = " + ".join(f"{ms_tok((k,)):.1f}" for k in srv_keys)
                print(
                    f"{path.name:30} {label:>7} {median(tps):9.1f} {min(tps):7.1f}..{max(tps):<7.1f} "
                    f"{median(tps) / n:10.1f} {median(x.wall_tps for x in runs):10.1f} "
                    f"{median(x.ttft for x in runs) * 1000:8.1f} {core:5.2f}  "
                    f"{ms_tok(('client',)):.2f} / {per_proc}"
                )
        print("  streams '1': one stream, the other slots erased; '1+': one stream while the other slots hold")
        print(f"  their {args.prompt + args.new}-token conversations (cells in the KV cache)")
        print()
        print("scaling (median aggregate tok/s):")
        lo, hi = str(min(counts)), str(max(counts))
        med = {p.name: {label: median(x.tps for x in p.runs[label]) for label, _, _ in loads} for p in paths}
        for p in paths:
            steps = ", ".join(f"x{lb}/x{lo} {med[p.name][lb] / med[p.name][lo]:.2f}" for lb, _, _ in loads if lb != lo)
            print(f"  {p.name:30} {steps}")
        mine_paths = [p for p in paths if p.kind != "llama"]
        for lp in (p for p in paths if p.kind == "llama"):
            llama = med[lp.name]
            goal = llama[hi] / llama[lo]
            print()
            for p in mine_paths:
                mine = med[p.name]
                sc = mine[hi] / mine[lo]
                print(
                    f"  {p.name:30} vs {lp.name}: x{lo} {mine[lo] / llama[lo]:.2f}, x{hi} {mine[hi] / llama[hi]:.2f} "
                    f"of its tok/s; scaling {sc:.2f} vs {goal:.2f} -> {'MET' if sc >= goal else 'NOT MET'}"
                )
        print()
        print(f"generated text vs {paths[0].name}, fewest streams (greedy; near-ties may flip between kernels):")
        first = {i: next(lb for lb, n, _ in loads if n > i) for i in range(max(counts))}
        ref = {i: texts[(paths[0].name, first[i], i)] for i in first}
        for p in paths:
            keys = [(lb, i) for lb, n, _ in loads for i in range(n) if (p.name, lb, i) != (paths[0].name, first[i], i)]
            common = [prefix_len(texts[(p.name, lb, i)], ref[i]) for lb, i in keys]
            same = sum(texts[(p.name, lb, i)] == ref[i] for lb, i in keys)
            if keys:
                print(
                    f"  {p.name:30} identical {same}/{len(keys)} streams; shortest common prefix {min(common)} "
                    f"of {min(len(t) for t in ref.values())}+ chars"
                )
        print(quiet.summary())
    finally:
        stop_servers(servers, tmp, args.keep_logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
