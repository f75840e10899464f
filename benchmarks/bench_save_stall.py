"""Four conversations decoding with full attention while a fifth slot's state is saved: the stall a save causes.

One ``slotserve serve --parallel 5`` (its defaults otherwise, ``--slot-save-path`` for the file saves) holds
five slots of ``--tokens`` tokens each (distinct prompts, prefilled first): slots 0-3, the four conversations,
and ``saved``, the fifth. Each rep, interleaved:

* **no save**: the four decode ``--new`` tokens each together over the binary WebSocket with full per-layer
  attention (``float32[L, H, ctx]`` per token, bench_table's four-conversation row with attention);
* the same while slot ``saved``'s state is saved again and again, one save after the other, from when all
  four have their first token until the first of them ends, by each path of ``--save``: ``api``
  (``POST /slots/saved?action=save-state`` with ``Accept: application/octet-stream``, the raw SES1 blob) and
  ``file`` (``POST /slots/saved?action=save``, llama.cpp's sequence-state file in ``--slot-save-path``);
  then one save of the same path alone (nothing decoding).

The four's aggregate tok/s is counted from token arrival times in the window where all four decode
(streams.py's :attr:`Run.window`); the longest gap is the longest interval between two consecutive tokens of
any one of the four inside that window (the stall a reader sees). Printed: medians over ``--reps`` (after a
warm-up rep) of the tok/s without and with each kind of save and their ratio, the longest gap in each case,
the saves per window and the share of the window spent saving, each save's own time during the decode and
alone, and its bytes. The saving client runs in this process beside the stream clients (a thread of its own,
``http.client``: big_slot.py's :class:`RawClient`), so on a small machine its own reading of the blob competes
for the cores too. Each measured run waits for an idle machine (``--wait-idle``) and is redone once while
other processes used more than ``--max-other`` cores; the load average is printed at the start and the end.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_save_stall.py [--tokens 2000] [--new 64] [--reps 3] \\
        [--save api,file] [--n-gpu-layers 99]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common  # also puts the checkout on sys.path
import httpx
from bench_preview import generate_sample
from big_slot import OCTET, RawClient
from common import Quiet, load, machine, median
from servers import ServerProc, default_model, free_port, settle, slotserve_cmd, stop_servers
from streams import Marks, Run, measure_streams, model_shape

SAVED = "saved"
"""The fifth slot, the one saved."""
FILENAME = "saved.bin"
PATHS = {"api": "saves through the API (octet-stream)", "file": "saves to a slot file (?action=save)"}


@dataclass
class Saver:
    """Saves slot :data:`SAVED` by one path (``api`` or ``file``, see the module docstring) with its own
    ``http.client`` connection; :attr:`log` holds each save's ``(start, end, bytes)`` (perf_counter s)."""

    raw: RawClient
    path: str
    log: list[tuple[float, float, int]] = field(default_factory=list)

    def once(self) -> int:
        """One save, logged; its bytes (the blob's length, or the file's ``n_written``). RuntimeError on an
        HTTP error."""
        t0 = time.perf_counter()
        if self.path == "api":
            status, blob = self.raw.request(
                "POST", f"/slots/{SAVED}?action=save-state&wait=true", headers={"Accept": OCTET}
            )
            if status != 200:
                raise RuntimeError(f"save-state: HTTP {status} {blob[:300]!r}")
            n = len(blob)
        else:
            n = int(self.raw.json(f"/slots/{SAVED}?action=save&wait=true", {"filename": FILENAME}, "save")["n_written"])
        self.log.append((t0, time.perf_counter(), n))
        return n

    async def during(self, marks: Marks) -> None:
        """Save one after the other (in a thread: the stream clients keep the event loop) from when every
        stream decodes until the first one ends."""
        await marks.decoding.wait()
        while not marks.ending.is_set():
            await asyncio.to_thread(self.once)

    def in_window(self, run: Run) -> tuple[int, float, float]:
        """``(saves started in the run's window, share of the window spent saving, median save s)``."""
        a, b = run.window
        inside = [(s, e) for s, e, _ in self.log if a <= s < b]
        busy = sum(min(e, b) - s for s, e in inside)
        return len(inside), busy / (b - a) if b > a else float("nan"), median(e - s for s, e in inside)


@dataclass
class Case:
    """The medians' inputs of one case (no save, or one path) over the measured reps."""

    tps: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    saves: list[float] = field(default_factory=list)
    share: list[float] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    alone_s: list[float] = field(default_factory=list)
    size: int = 0


def prefill(client: httpx.Client, base: str, slot: str, ids: list[int]) -> None:
    """``ids`` into ``slot`` (no new token); RuntimeError unless all of them were prefilled."""
    s = generate_sample(client, base, slot, ids, 0)
    if s.n_prefilled != len(ids):
        raise RuntimeError(f"prefill of {slot}: {s.n_prefilled} of {len(ids)} tokens prefilled")
    print(f"  prefilled slot {slot}: {len(ids)} tokens in {s.wall * 1000:.0f} ms", flush=True)


def measure(args: argparse.Namespace, srv: ServerProc, quiet: Quiet, client: httpx.Client) -> dict[str, Case]:
    """Every rep of every case (see the module docstring); the warm-up rep is not kept."""
    tok = common.http_tokenizer(client, srv.base)
    shape = model_shape(client, srv.base)
    prompts = [common.build_prompt(tok, args.tokens, variant=i + 1) for i in range(5)]
    for slot, ids in zip(["0", "1", "2", "3", SAVED], prompts, strict=True):
        prefill(client, srv.base, slot, ids)
    paths = [p for p in args.save.split(",") if p]
    cases: dict[str, Case] = {name: Case() for name in ["none", *paths]}
    raw = RawClient(srv.base)
    try:
        for r in range(args.reps + 1):
            for name, case in cases.items():
                settle(client, srv.base)
                saver = Saver(raw, name) if name != "none" else None
                run, _ = measure_streams(
                    quiet, "ws", srv.base, prompts, 4, args.new, shape, name, r == 0, saver.during if saver else None
                )
                line = f"  rep {r} {name}: {run.tps:.1f} tok/s, longest gap {run.longest_gap * 1000:.1f} ms"
                if r == 0:
                    line += f", cached tokens {[s.cached for s in run.streams]}"
                if saver is not None:
                    n, share, save_s = saver.in_window(run)
                    settle(client, srv.base)
                    quiet.run(saver.once, "alone", r == 0)
                    alone = saver.log[-1][1] - saver.log[-1][0]
                    line += f"; {n} saves in the window ({share:.0%} of it), {save_s * 1000:.1f} ms each"
                    line += f", alone {alone * 1000:.1f} ms, {saver.log[-1][2] / 1e6:.1f} MB"
                    if r:
                        case.saves.append(n)
                        case.share.append(share)
                        case.save_s.append(save_s)
                        case.alone_s.append(alone)
                        case.size = saver.log[-1][2]
                print(line, flush=True)
                if r:
                    case.tps.append(run.tps)
                    case.gap.append(run.longest_gap)
    finally:
        raw.close()
    return cases


def report(args: argparse.Namespace, cases: dict[str, Case]) -> None:
    """The rows (medians), one per case."""
    base = median(cases["none"].tps)
    head = f"four conversations of {args.tokens} tokens, full per-layer attention (WS), {args.new} new each"
    print(f"{head}, no save: {base:.1f} tok/s; longest gap {median(cases['none'].gap) * 1000:.1f} ms")
    for name, c in cases.items():
        if name == "none":
            continue
        tps = median(c.tps)
        print(
            f"{head}, {PATHS[name]} of a {args.tokens}-token slot ({c.size / 1e6:.1f} MB): {tps:.1f} tok/s = "
            f"{tps / base:.2f} of no save; longest gap {median(c.gap) * 1000:.1f} ms; "
            f"{median(c.saves):.0f} saves per window ({median(c.share):.0%} of it); "
            f"a save {median(c.save_s) * 1000:.1f} ms during the decode, {median(c.alone_s) * 1000:.1f} ms alone"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="tokens of each of the five slots")
    ap.add_argument("--new", type=int, default=64, help="new tokens per conversation")
    ap.add_argument("--reps", type=int, default=3, help="measured reps (+1 warm-up), the cases interleaved")
    ap.add_argument("--save", default="api,file", help="comma-separated save paths: api, file")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--ctx-size", type=int, default=4096, help="context per slot")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--keep-logs", action="store_true")
    common.add_gpu_args(ap)
    common.add_idle_args(ap, wait_idle_s=5, max_other=0.5)
    ap.set_defaults(retries=1)
    args = ap.parse_args()
    bad = [p for p in args.save.split(",") if p and p not in PATHS]
    if bad or args.tokens < 64 or args.new < 2 or args.reps < 1 or args.tokens + args.new > args.ctx_size:
        ap.error(f"--save takes {', '.join(PATHS)}; --tokens >= 64, --new >= 2, --reps >= 1, tokens + new <= ctx")
    model = args.model or default_model()
    print(f"machine: {machine()}; --n-gpu-layers {args.n_gpu_layers}; threads {args.threads}; {load()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-save-stall-"))
    port = free_port()
    cmd = slotserve_cmd(
        port, tmp / "state", parallel=5, ctx_size=args.ctx_size, threads=args.threads, spare=None, model=model,
        n_gpu_layers=args.n_gpu_layers, extra=["--slot-save-path", str(tmp / "slots")],
    )  # fmt: skip
    (tmp / "slots").mkdir()
    srv = ServerProc("slotserve", cmd, port, tmp / "slotserve.log")
    try:
        print(f"slotserve ready on :{port} in {srv.wait_ready(httpx):.1f}s", flush=True)
        quiet = Quiet(args, srv.pids())
        with httpx.Client(timeout=None) as client:
            cases = measure(args, srv, quiet, client)
        print(quiet.summary())
    finally:
        stop_servers([srv], tmp, args.keep_logs)
    print()
    print(f"machine: {machine()}; --n-gpu-layers {args.n_gpu_layers}; threads {args.threads}; model {model.name}")
    print(f"at the end: {load()}")
    report(args, cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
