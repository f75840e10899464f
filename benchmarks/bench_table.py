"""slotserve beside llama-server (built from the same llama.cpp) on this machine, in one run.

Both servers run side by side (``slotserve serve`` with its default flags: ``--parallel 4``, flash attention
``auto``, persistence to an embedded store; ``llama-server -np 4`` with its defaults and ``--slot-save-path``),
both with ``--threads`` and ``--n-gpu-layers``. Rows, each with its ratio:

1. **one stream** at each of ``--prompts`` tokens of context (``--new`` new, greedy, ``ignore_eos``, the
   prompt cached after the warm-up): decode tok/s of slotserve's SSE without attention, its WebSocket
   without attention, the WebSocket with full per-layer attention (``float32[L, H, ctx]`` per token) and SSE
   with aggregated attention (Halo Weave's path), beside llama-server's ``/completion`` stream; WS full / WS
   none and SSE aggregated / SSE none are the capture's cost;
2. **four conversations** of ``--stream-prompt`` tokens (distinct prompts, one slot each): one alone (the
   others erased), the four decoding together (aggregate tok/s, x4 / x1, beside llama-server), then one
   again right after them, the three others resident, with full per-layer (WS) and aggregated (SSE)
   attention, beside llama-server's one alone without attention; then ``save-state`` of slot 0;
3. **a ``--big``-token slot** (``big_slot.py``): prefill, ``save-state`` / ``restore-state`` (octet-stream
   bodies, moved with ``http.client``) through the API and slotserve's own slot files vs llama-server's prefill
   and slot-file ``save`` / ``restore`` (``POST /slots/0?action=save``), and the HTTP floor (the same bytes
   through Litestar + uvicorn alone);
4. **preview** of that slot (append ``--append`` tokens, ``--preview-new`` new) / prefill + generate of the
   same tokens on a fresh slot (``bench_preview.py``'s requests);
5. **in-process engine** (the servers stopped first, ``engine_rows.py``): decode tok/s and attention bytes per
   token without attention, aggregated and full per-layer at each of ``--growth`` tokens of context; attention
   vs transformers' eager float32 reference (``tests/engine/hf_reference.py``; skipped without
   torch/transformers): min per-head correlation and worst head mean abs diff, f16 and f32 KV cache, flash
   attention on and off.

Each measured call waits for an idle machine (``--wait-idle``) and is redone once while other processes used
more than ``--max-other`` cores; the load average is printed at the start and the end.

    .venv/bin/python benchmarks/bench_table.py --llama-server /path/to/llama-server [--n-gpu-layers 99]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common  # also puts the checkout on sys.path
import httpx
import llama_cpp  # noqa: F401 - llama.cpp before numpy (docs/hardware.md)
from bench_preview import context, generate_sample, preview_sample, user_append
from big_slot import big_slot
from common import Quiet, load, machine, median, step_tps, token_gaps
from engine_rows import in_process
from servers import ServerProc, check, default_model, free_port, llama_server_cmd, settle, slotserve_cmd, stop_servers
from streams import measure_streams, model_shape

OCTET = "application/octet-stream"


@dataclass
class Table:
    """The printed rows: what, slotserve, llama-server, ratio."""

    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, what: str, mine: str, llama: str = "-", ratio: str = "-") -> None:
        self.rows.append((what, mine, llama, ratio))
        print(f"  => {what}: {mine} | {llama} | {ratio}", flush=True)

    def write_json(self, path: Path, about: dict[str, str]) -> None:
        """The rows as ``{"about": {...}, "rows": [{"row", "slotserve", "llama_server", "ratio"}, ...]}``."""
        rows = [dict(zip(("row", "slotserve", "llama_server", "ratio"), r, strict=True)) for r in self.rows]
        path.write_text(json.dumps({"about": about, "rows": rows}, indent=1))

    def print(self) -> None:
        w = [max(len(r[i]) for r in self.rows) for i in range(4)]
        w = [max(x, len(h)) for x, h in zip(w, ("row", "slotserve", "llama-server", "ratio"), strict=True)]
        line = " | ".join(h.ljust(n) for h, n in zip(("row", "slotserve", "llama-server", "ratio"), w, strict=True))
        print(line)
        print("-" * len(line))
        for r in self.rows:
            print(" | ".join(c.ljust(n) for c, n in zip(r, w, strict=True)))


class Bench:
    """Both servers and the measurements of one run."""

    def __init__(
        self, args: argparse.Namespace, ss: ServerProc, ls: ServerProc | None, quiet: Quiet, table: Table, tmp: Path
    ) -> None:
        self.args, self.ss, self.ls, self.quiet, self.table = args, ss, ls, quiet, table
        self.tmp, self.httpx = tmp, httpx
        self.client = httpx.Client(timeout=None)
        self.shape = model_shape(self.client, ss.base)
        self.tok = common.http_tokenizer(self.client, ss.base)

    def timed(self, fn, label: str, warm: bool = False, once: bool = False):  # type: ignore[no-untyped-def]
        """``(seconds, fn())`` on an idle machine (:meth:`common.Quiet.run`). ``once``: for a call that
        cannot be repeated alike (a prefill fills the slot it measures): after the wait, never redone."""

        def run():  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = fn()
            return time.perf_counter() - t0, out

        if once:
            self.quiet.wait()
            (dt, out), cpu = self.quiet.run(run, label, warm=True)
            print(f"  {label}: {dt * 1000:.1f} ms, other processes {cpu['other']:.2f} cores", flush=True)
            return dt, out
        return self.quiet.run(run, label, warm=warm)[0]

    def erase(self, base: str, slots: list[str]) -> None:
        for slot in slots:
            r = self.client.post(f"{base}/slots/{slot}", params={"action": "erase", "wait": "true"})
            if r.status_code not in (200, 404):
                raise RuntimeError(f"erase {slot}: HTTP {r.status_code} {r.text[:200]}")

    def paths(self, kinds: list[tuple[str, str]]) -> list[tuple[str, str, ServerProc]]:
        out = [(name, kind, self.ss) for name, kind in kinds]
        return out + ([("llama-server", "llama", self.ls)] if self.ls else [])

    def one_stream(self) -> None:
        a, t = self.args, self.table
        kinds = [
            ("SSE, no attention", "sse"),
            ("WS, no attention", "ws-plain"),
            ("WS, full per-layer attention", "ws"),
            ("SSE, aggregated attention", "sse-agg"),
        ]
        paths = self.paths(kinds)
        for n_prompt in (int(x) for x in a.prompts.split(",")):
            ids = [common.build_prompt(self.tok, n_prompt)]
            tps: dict[str, list[float]] = {name: [] for name, _, _ in paths}
            gaps: dict[str, list[float]] = {name: [] for name, _, _ in paths}
            for r in range(a.reps + 1):
                for name, kind, srv in paths:
                    if kind != "llama":
                        settle(self.client, srv.base)
                    run, _ = measure_streams(self.quiet, kind, srv.base, ids, 1, a.new, self.shape, name, r == 0)
                    print(f"  rep {r} {n_prompt} tokens, {name}: {run.tps:.1f} tok/s", flush=True)
                    if r:
                        tps[name].append(run.tps)
                        gaps[name] += token_gaps(run.streams[0].times)
            ref = step_tps(gaps["llama-server"]) if self.ls else float("nan")
            lt = f"{ref:.1f}" if self.ls else "-"
            for name, _ in kinds:
                m = step_tps(gaps[name])
                t.add(f"one stream at {n_prompt} tokens, decode tok/s: {name}", f"{m:.1f}", lt, f"{m / ref:.2f}")
            plain, full = step_tps(gaps["WS, no attention"]), step_tps(gaps["WS, full per-layer attention"])
            agg, sse = step_tps(gaps["SSE, aggregated attention"]), step_tps(gaps["SSE, no attention"])
            t.add(f"capture cost at {n_prompt} tokens: WS full / WS none; SSE aggregated / SSE none",
                  f"{full / plain:.3f}; {agg / sse:.3f}")  # fmt: skip

    def streams(self) -> None:
        """Four conversations of ``--stream-prompt`` tokens: one alone (the others erased), the four decoding
        together, then one again right after them (the three others resident) with full per-layer attention
        (WS) and with aggregated attention (SSE)."""
        a, t = self.args, self.table
        prompts = [common.build_prompt(self.tok, a.stream_prompt, variant=i + 1) for i in range(4)]
        runs = [("x1", "sse", 1, True), ("x4", "sse", 4, False), ("after x4, WS full", "ws", 1, False),
                ("after x4, SSE aggregated", "sse-agg", 1, False)]  # fmt: skip
        agg: dict[tuple[str, str], list[float]] = {}
        saved: dict = {}
        for r in range(a.reps + 1):
            for name, kind, srv in self.paths([("slotserve", "sse")]):
                for label, skind, n, alone in runs:
                    if kind == "llama" and label != "x4" and label != "x1":
                        continue
                    if alone:
                        self.erase(srv.base, ["1", "2", "3"])
                    if kind != "llama":
                        settle(self.client, srv.base)
                    kk = "llama" if kind == "llama" else skind
                    run, _ = measure_streams(self.quiet, kk, srv.base, prompts, n, a.new, self.shape, name, r == 0)
                    print(f"  rep {r} {name} {label}: {run.tps:.1f} tok/s", flush=True)
                    if r:
                        agg.setdefault((name, label), []).append(run.tps)
                    if label == "x4" and kind != "llama" and r == a.reps:  # right away, before any settle
                        t0 = time.perf_counter()
                        saved = check(
                            self.client.post(f"{srv.base}/slots/0", params={"action": "save-state", "wait": "true"}),
                            "save-state",
                        )
                        saved["wall_ms"] = (time.perf_counter() - t0) * 1000
        p = a.stream_prompt
        ll = {k: median(agg[("llama-server", k)]) if self.ls else float("nan") for k in ("x1", "x4")}
        ss = {label: median(agg[("slotserve", label)]) for label, *_ in runs}
        t.add(f"4 conversations of {p} tokens decoding together, aggregate tok/s", f"{ss['x4']:.1f}", f"{ll['x4']:.1f}",
              f"{ss['x4'] / ll['x4']:.2f}")  # fmt: skip
        t.add(
            f"1 conversation of {p} tokens alone, tok/s",
            f"{ss['x1']:.1f}",
            f"{ll['x1']:.1f}",
            f"{ss['x1'] / ll['x1']:.2f}",
        )
        t.add("x4 / x1", f"{ss['x4'] / ss['x1']:.2f}", f"{ll['x4'] / ll['x1']:.2f}", "")
        for label in ("after x4, WS full", "after x4, SSE aggregated"):
            t.add(f"1 conversation, three others resident ({label}) vs llama-server x1 without attention",
                  f"{ss[label]:.1f}", f"{ll['x1']:.1f}", f"{ss[label] / ll['x1']:.2f}")  # fmt: skip
        t.add(
            f"save-state of slot 0 after 4 streams ({saved['n_tokens']} tokens, {saved['n_bytes'] / 1e6:.1f} MB): "
            "worker t_ms / client round trip (JSON, base64)",
            f"{saved['t_ms']:.1f} / {saved['wall_ms']:.1f} ms",
        )

    def llama_complete(self, slot: int, ids: list[int]) -> dict:
        body = {"prompt": ids, "n_predict": 1, "temperature": 0, "id_slot": slot, "cache_prompt": True}
        return check(self.client.post(self.ls.base + "/completion", json=body), "llama-server /completion")

    def llama_slot(self, slot: int, action: str, filename: str) -> dict:
        r = self.client.post(f"{self.ls.base}/slots/{slot}", params={"action": action}, json={"filename": filename})
        return check(r, f"llama-server slot {action}")

    def big_slot(self) -> None:
        ctx = context(self.tok, self.args.big)
        big_slot(self, ctx)
        self.preview(ctx)

    def preview(self, ctx: list[int]) -> None:
        a, base = self.args, self.ss.base
        append = user_append(self.tok, a.append)
        pv, sc = [], []
        for r in range(a.reps + 1):
            settle(self.client, base)
            s = self.timed(lambda: preview_sample(self.client, base, "big", append, a.preview_new), "preview", r == 0)[
                1
            ]
            print(f"  rep {r}: preview {s.wall * 1000:.1f} ms ({s.n_gen} tokens, prefilled {s.n_prefilled})")
            if r:
                pv.append(s.wall)
        for _ in range(a.scratch_reps):
            settle(self.client, base)
            s = self.timed(
                lambda: generate_sample(self.client, base, "scratch", ctx + append, a.preview_new), "scratch", once=True
            )
            print(f"  scratch {s[1].wall * 1000:.1f} ms ({s[1].n_gen} tokens)", flush=True)
            sc.append(s[1].wall)
            self.erase(base, ["scratch"])
        p, s_ = median(pv) * 1000, median(sc) * 1000
        self.table.add(
            f"preview (append {a.append}, {a.preview_new} new) / (prefill + generate) at {a.big} tokens",
            f"{p:.0f} / {s_:.0f} ms = {p / s_:.2f}",
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (no llama rows without)")
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments (default: its defaults)")
    ap.add_argument("--slotserve-args", default="", help="extra slotserve serve arguments, e.g. '--stream-window 64'")
    ap.add_argument("--model", type=Path, default=None)
    common.add_gpu_args(ap)
    sizes = {
        "threads": (2, "llama.cpp threads, both servers and the in-process engines"),
        "ctx-size": (4096, "context per slot, both servers"),
        "new": (64, "new tokens per stream"),
        "stream-prompt": (2000, "four conversations: prompt tokens each"),
        "big": (2000, "tokens of the slot saved, restored and previewed"),
        "append": (15, "preview: appended tokens"),
        "preview-new": (50, "preview: new tokens"),
        "reps": (2, "measured reps (+1 warm-up)"),
        "scratch-reps": (1, "prefill + generate runs (long)"),
    }
    ap.add_argument("--prompts", default="500,4000", help="one stream: prompt sizes, tokens")
    ap.add_argument(
        "--flash-attn", default="auto", choices=("auto", "on", "off"), help="slotserve's (server and in process)"
    )
    ap.add_argument(
        "--capture-graph", default="auto", choices=("auto", "stable", "lean"), help="slotserve's, server and in process"
    )
    ap.add_argument("--growth", default="500,2000,4000,8000", help="in process: context sizes, tokens")
    for flag, (default, text) in sizes.items():
        ap.add_argument("--" + flag, type=int, default=default, help=text)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: stream,streams,big,inproc")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the table's rows to this JSON file")
    common.add_idle_args(ap, wait_idle_s=5, max_other=0.5)
    ap.set_defaults(retries=1)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    model = args.model or default_model()
    print(f"machine: {machine()}; --n-gpu-layers {args.n_gpu_layers}; {load()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-table-"))
    servers: list[ServerProc] = []
    table = Table()
    try:
        if {"stream", "streams", "big"} - skip:
            port = free_port()
            cmd = slotserve_cmd(
                port, tmp / "state", parallel=4, spare=2, ctx_size=args.ctx_size, threads=args.threads, model=model,
                n_gpu_layers=args.n_gpu_layers,
                extra=[
                    "--slot-save-path", str(tmp / "slotserve-slots"), "--flash-attn", args.flash_attn,
                    "--capture-graph", args.capture_graph, *shlex.split(args.slotserve_args),
                ],
            )  # fmt: skip
            servers.append(ServerProc("slotserve", cmd, port, tmp / "slotserve.log"))
            if args.llama_server:
                lport = free_port()
                lcmd = llama_server_cmd(
                    args.llama_server, model, lport, parallel=4, ctx_size=args.ctx_size, threads=args.threads,
                    n_gpu_layers=args.n_gpu_layers, slot_dir=tmp / "llama-slots", extra=args.llama_args,
                )  # fmt: skip
                servers.append(ServerProc("llama-server", lcmd, lport, tmp / "llama-server.log"))
            for srv in servers:
                print(f"{srv.name} ready on :{srv.port} in {srv.wait_ready(httpx):.1f}s", flush=True)
            pids: dict[str, int] = {}
            for srv in servers:
                pids |= srv.pids()
            bench = Bench(args, servers[0], servers[1] if len(servers) > 1 else None, Quiet(args, pids), table, tmp)
            for part, fn in (("stream", bench.one_stream), ("streams", bench.streams), ("big", bench.big_slot)):
                if part not in skip:
                    print(f"[{part}] {load()}", flush=True)
                    fn()
            print(bench.quiet.summary())
            stop_servers(servers, tmp, args.keep_logs)
            servers = []
        if "inproc" not in skip:
            print(f"[inproc] {load()}", flush=True)
            quiet = Quiet(args)
            in_process(args, quiet, table.add)
            print(quiet.summary())
    finally:
        stop_servers(servers, tmp, args.keep_logs)
    print()
    print(f"machine: {machine()}; --n-gpu-layers {args.n_gpu_layers}; threads {args.threads}; model {model.name}")
    if args.llama_server:
        print(f"llama-server: {args.llama_server} -np 4 -c {4 * args.ctx_size} {args.llama_args}".rstrip())
    print(f"at the end: {load()}")
    print()
    table.print()
    if args.json:
        about = {"machine": machine(), "n_gpu_layers": str(args.n_gpu_layers), "threads": str(args.threads)}
        table.write_json(args.json, about | {"model": model.name, "llama_server": str(args.llama_server or "")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
