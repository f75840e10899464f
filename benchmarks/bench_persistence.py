"""Slot persistence: state size, codecs, Redis save/restore, engine restore and park/resume vs. re-prefill.

For each slot size (``--sizes``, default about 500, 2000 and 4000 tokens):

1. **a real slot state**: on a slotserve (``--parallel 3 --no-persist``), a slot is filled by
   generating (prompt of n - 16 tokens, 16 new tokens), and ``POST /slots/{id}?action=save-state``
   with ``Accept: application/octet-stream`` gives its SES1 blob (the slot is then erased);
2. **codecs**, in-process with :mod:`slotstate.codec`: compressed size, ratio, compression and
   decompression time for ``zstd`` and ``zstd-planes`` at ``--levels`` (default 1 and 3);
3. **Redis**, in-process: ``storage.slot_codec.save_slot`` / ``load_slot`` through
   ``storage.redis_store.RedisStore`` on a throw-away ``redis-server`` (``tests/redis_server.py``),
   per codec (and ``none``: the transfer alone); Redis runs without its append-only file unless
   ``--aof`` (its rewrites and the kernel's writeback otherwise disturb the figures);
4. **engine restore through the API**: ``restore-state`` of the blob (raw body) into a new slot, and
   ``save-state`` of that slot back (raw), client round trips;
5. **re-prefill**: the same tokens from scratch on a fresh slot (``max_new_tokens: 0``);
6. **park + resume**, end to end, on a second slotserve with ``--parallel 1 --redis-url`` (same
   redis-server): a request (the slot's tokens, 1 new token) on the slot while it is parked in Redis
   (it is restored first) vs. the same request while it is resident; and parking a dirty slot (a
   request on another slot right after one on this slot evicts it, saving it first) vs. that other
   request when nothing is evicted.

Steps 4 and 5 run on an otherwise empty KV cache and alternate. Every measured rep waits for an idle
machine (steps 2 and 3: once per codec, before its reps) and is redone if other processes were busy
meanwhile (``--wait-idle`` / ``--max-other``); medians of
``--reps`` (re-prefills, which take tens of seconds: ``--prefill-reps``).
Goal: restore / re-prefill < 0.05 at 2000 tokens.

    .venv/bin/python benchmarks/bench_persistence.py [--sizes 500,2000,4000] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import Quiet, add_gpu_args, add_idle_args, build_prompt, http_tokenizer, median
from servers import ServerProc, check, default_model, free_port, settle, slotserve_cmd, stop_servers

from slotstate import codec as codecs
from slotstate.ses1 import ses1_tokens
from storage.redis_store import RedisStore
from storage.slot_codec import load_slot, save_slot
from tests.redis_server import RedisServer

OCTET = "application/octet-stream"


@dataclass
class CodecRow:
    codec: str
    level: int
    size: int = 0
    enc: list[float] = field(default_factory=list)
    dec: list[float] = field(default_factory=list)
    put: list[float] = field(default_factory=list)  # save_slot to Redis
    get: list[float] = field(default_factory=list)  # load_slot from Redis


@dataclass
class SizeResult:
    n: int
    raw: int = 0
    fill_s: float = 0.0
    codecs: list[CodecRow] = field(default_factory=list)
    api_save: list[float] = field(default_factory=list)  # client round trip, save-state (raw)
    api_restore: list[float] = field(default_factory=list)  # client round trip, restore-state (raw body)
    api_restore_t_ms: list[float] = field(default_factory=list)  # the server's t_ms
    prefill: list[float] = field(default_factory=list)
    resume: list[float] = field(default_factory=list)
    resident: list[float] = field(default_factory=list)
    park_dirty: list[float] = field(default_factory=list)
    other_alone: list[float] = field(default_factory=list)
    park_codec: str = ""
    park_stored: int = 0


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


class Bench:
    """The servers, the store and the measurements of one run."""

    def __init__(self, args: argparse.Namespace, client: httpx.Client, quiet: Quiet, store: RedisStore) -> None:
        self.args = args
        self.client = client
        self.quiet = quiet
        self.store = store
        self.loop = asyncio.new_event_loop()
        self.s1: ServerProc | None = None  # --no-persist: state, engine restore, re-prefill
        self.s2: ServerProc | None = None  # --parallel 1 --redis-url: park + resume
        self.fingerprint = ""
        self.tok = None

    # -------------------------------------------------------------- helpers

    def generate(self, base: str, slot: str, ids: list[int], new: int) -> tuple[float, dict]:
        body = {"input_ids": ids, "max_new_tokens": new, "temperature": 0, "id_slot": slot, "wait": True}
        t0 = time.perf_counter()
        d = check(self.client.post(base + "/api/v1/generate", json=body), f"generate on {slot}")
        return time.perf_counter() - t0, d

    def action(self, base: str, slot: str, name: str, **kw) -> httpx.Response:
        r = self.client.post(f"{base}/slots/{slot}", params={"action": name, "wait": "true"}, **kw)
        if r.status_code // 100 != 2:
            raise RuntimeError(f"{name} on {slot}: HTTP {r.status_code} {r.text[:300]}")
        return r

    def timed(self, fn, label: str, warm: bool = False, wait: bool = True):
        """(seconds, fn's result) of one ``fn()`` on an idle machine (see :class:`common.Quiet`)."""

        def run():
            t0 = time.perf_counter()
            out = fn()
            return time.perf_counter() - t0, out

        (dt, out), _cpu = self.quiet.run(run, label, warm, wait)
        return dt, out

    # -------------------------------------------------------------- steps

    def real_state(self, res: SizeResult) -> tuple[bytes, list[int]]:
        """1. fill a slot (prompt n - 16, 16 new tokens) and take its SES1 blob."""
        assert self.s1 is not None and self.tok is not None
        base, n = self.s1.base, res.n
        prompt = build_prompt(self.tok, n - 16, variant=n % 7 + 1)
        src = f"src-{n}"
        res.fill_s, _ = self.generate(base, src, prompt, 16)
        blob = self.action(base, src, "save-state", headers={"Accept": OCTET}).content
        self.action(base, src, "erase")
        res.raw = len(blob)
        return blob, ses1_tokens(blob)

    def codecs(self, res: SizeResult, blob: bytes, levels: list[int]) -> None:
        """2. in-process compression and decompression."""
        for c in ("zstd", "zstd-planes"):
            for lv in levels:
                row = CodecRow(c, lv)
                res.codecs.append(row)
                self.quiet.wait()  # once for the row's short calls (each is still checked)
                for _ in range(self.args.reps):
                    dt, enc = self.timed(
                        lambda row=row: codecs.encode(blob, row.codec, row.level), f"encode {c}", wait=False
                    )
                    row.enc.append(dt)
                    dt, dec = self.timed(
                        lambda row=row, enc=enc: codecs.decode(enc, row.codec), f"decode {c}", wait=False
                    )
                    row.dec.append(dt)
                    assert dec == blob
                    row.size = len(enc)
        res.codecs.append(CodecRow("none", 0, size=len(blob)))

    def redis(self, res: SizeResult, blob: bytes, tokens: list[int]) -> None:
        """3. save_slot / load_slot through Redis, per codec."""
        run = self.loop.run_until_complete
        for row in res.codecs:
            sid = f"p-{res.n}-{row.codec}-{row.level}"
            self.quiet.wait()
            for _ in range(self.args.reps):
                dt, meta = self.timed(
                    lambda sid=sid, row=row: run(
                        save_slot(self.store, sid, self.fingerprint, tokens, blob, codec=row.codec, level=row.level)
                    ),
                    f"save_slot {row.codec}",
                    wait=False,
                )
                row.put.append(dt)
                assert meta.stored_size == row.size
                dt, got = self.timed(
                    lambda sid=sid: run(load_slot(self.store, sid, self.fingerprint)), "load_slot", wait=False
                )
                row.get.append(dt)
                assert got is not None and got[1] == blob
            run(self.store.delete(sid))

    def engine(self, res: SizeResult, blob: bytes, tokens: list[int]) -> None:
        """4 + 5. restore-state / save-state through the API vs re-prefill, alternating, empty cache.

        Restores: ``--reps`` after a warm-up; re-prefills (long): ``--prefill-reps``, no warm-up (the
        server was warmed up at the start)."""
        assert self.s1 is not None
        base = self.s1.base
        for r in range(max(self.args.reps, self.args.prefill_reps) + 1):
            warm = r == 0
            line = f"  rep {r}{' (warm-up)' if warm else ''}:"
            if r <= self.args.reps:
                dst = f"restored-{res.n}-{r}"
                dt, resp = self.timed(
                    lambda dst=dst: self.action(
                        base, dst, "restore-state", content=blob, headers={"Content-Type": OCTET}
                    ),
                    "restore-state",
                    warm,
                )
                t_ms = resp.json()["t_ms"]
                dt_save, saved = self.timed(
                    lambda dst=dst: self.action(base, dst, "save-state", headers={"Accept": OCTET}), "save-state", warm
                )
                if saved.content != blob:
                    print("  note: save-state after restore-state differs from the original blob", flush=True)
                self.action(base, dst, "erase")
                line += f" restore-state {dt * 1000:.1f} ms (t_ms {t_ms}), save-state {dt_save * 1000:.1f} ms"
                if not warm:
                    res.api_restore.append(dt)
                    res.api_restore_t_ms.append(t_ms)
                    res.api_save.append(dt_save)
            if 1 <= r <= self.args.prefill_reps:
                fresh = f"prefill-{res.n}-{r}"
                dt_pf, (_, d) = self.timed(lambda fresh=fresh: self.generate(base, fresh, tokens, 0), "re-prefill")
                if d.get("cached_tokens"):
                    raise RuntimeError(f"re-prefill found {d['cached_tokens']} cached tokens")
                self.action(base, fresh, "erase")
                line += f", re-prefill {dt_pf * 1000:.1f} ms"
                res.prefill.append(dt_pf)
            print(line, flush=True)

    def park(self, res: SizeResult, blob: bytes, tokens: list[int]) -> None:
        """6. park + resume end to end on the --parallel 1 server."""
        assert self.s2 is not None and self.tok is not None
        base = self.s2.base
        a, b = f"conv-{res.n}", f"other-{res.n}"
        short = build_prompt(self.tok, 16, variant=1)
        # a holds the slot's tokens (restored, not prefilled again), then it is written behind to Redis
        self.action(base, a, "restore-state", content=blob, headers={"Content-Type": OCTET})
        settle(self.client, base)

        def park_dirty() -> float:
            # a request on a (a is then dirty), at once one on b, which evicts a (saving it first,
            # before the write-behind starts); only b's request is timed
            self.generate(base, a, tokens[:-1], 1)
            return self.generate(base, b, short, 1)[0]

        for r in range(self.args.reps + 1):
            warm = r == 0
            self.generate(base, b, short, 1)  # evicts a (stored, clean: no save)
            settle(self.client, base)
            dt_resume, _ = self.timed(lambda: self.generate(base, a, tokens, 1), "resume", warm)
            settle(self.client, base)
            dt_res, _ = self.timed(lambda: self.generate(base, a, tokens, 1), "resident", warm)
            settle(self.client, base)
            _, dt_park = self.timed(park_dirty, "park", warm)
            settle(self.client, base)
            dt_alone, _ = self.timed(lambda: self.generate(base, b, short, 1), "other alone", warm)
            settle(self.client, base)
            print(
                f"  rep {r}{' (warm-up)' if warm else ''}: request on parked slot {dt_resume * 1000:.1f} ms, "
                f"resident {dt_res * 1000:.1f} ms; other slot evicting a dirty one {dt_park * 1000:.1f} ms, "
                f"alone {dt_alone * 1000:.1f} ms",
                flush=True,
            )
            if not warm:
                res.resume.append(dt_resume)
                res.resident.append(dt_res)
                res.park_dirty.append(dt_park)
                res.other_alone.append(dt_alone)
        self.generate(base, b, short, 1)  # park a once more, to read its stored codec and size
        settle(self.client, base)
        listed = check(self.client.get(base + "/slots"), "slots")
        meta = next((s for s in listed if str(s.get("id")) == a), {})
        res.park_codec, res.park_stored = meta.get("codec", "?"), meta.get("stored_bytes", 0)
        self.action(base, a, "erase")
        self.action(base, b, "erase")


def report(args: argparse.Namespace, model: Path, redis_url: str, results: list[SizeResult], quiet: Quiet) -> None:
    ms = 1000.0
    print()
    print(
        f"model {model.name}, threads {args.threads}, cpus {os.cpu_count()}, --ctx-size {args.ctx_size}; "
        f"Redis {redis_url} (local, AOF {'on' if args.aof else 'off'}); median of {args.reps} reps "
        f"({args.prefill_reps} re-prefills)"
    )
    print()
    print("codecs (in-process, one thread) and Redis (storage.slot_codec save_slot / load_slot, incl. codec):")
    hdr = (
        f"{'tokens':>6} {'SES1 MB':>7} {'codec':>14} {'MB':>6} {'ratio':>6} {'enc ms':>7} {'MB/s':>6} "
        f"{'dec ms':>7} {'save ms':>8} {'load ms':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for res in results:
        for row in res.codecs:
            enc = median(row.enc) if row.enc else 0.0
            name = row.codec if row.codec == "none" else f"{row.codec}-{row.level}"
            rate = f"{res.raw / enc / 1e6:6.0f}" if enc else f"{'-':>6}"
            dec = f"{median(row.dec) * ms:7.1f}" if row.dec else f"{'-':>7}"
            print(
                f"{res.n:6} {mb(res.raw):>7} {name:>14} {mb(row.size):>6} {res.raw / row.size:6.3f} "
                f"{enc * ms:7.1f} {rate} {dec} {median(row.put) * ms:8.1f} {median(row.get) * ms:8.1f}"
            )
    print()
    print("engine (API round trips, raw bodies) vs re-prefill (fresh slot, max_new_tokens 0), empty KV cache:")
    hdr = (
        f"{'tokens':>6} {'fill ms':>8} {'restore ms':>10} {'(t_ms)':>8} {'save ms':>8} {'re-prefill ms':>13} "
        f"{'restore/prefill':>15} {'load ms':>8} {'(load+restore)/prefill':>22}"
    )
    print(hdr)
    print("-" * len(hdr))
    ratio = {}
    for res in results:
        rest, pf = median(res.api_restore), median(res.prefill)
        fastest = min((r for r in res.codecs if r.codec != "none"), key=lambda r: median(r.get))
        ratio[res.n] = rest / pf
        load = median(fastest.get)
        print(
            f"{res.n:6} {res.fill_s * ms:8.1f} {rest * ms:10.1f} {median(res.api_restore_t_ms):8.1f} "
            f"{median(res.api_save) * ms:8.1f} {pf * ms:13.1f} {rest / pf:15.4f} {load * ms:8.1f} "
            f"{(load + rest) / pf:22.4f}"
        )
    print("  load = load_slot from Redis with the fastest-loading compressed codec of the table above")
    if any(res.resume for res in results):
        print()
        print("park + resume end to end (--parallel 1 --redis-url; request = the slot's tokens + 1 new token):")
        hdr = (
            f"{'tokens':>6} {'stored as':>20} {'parked ms':>9} {'resident ms':>11} {'resume cost ms':>14} "
            f"{'cost/prefill':>12} {'park dirty ms':>13} {'alone ms':>8} {'park cost ms':>12}"
        )
        print(hdr)
        print("-" * len(hdr))
        for res in results:
            cost = median(res.resume) - median(res.resident)
            park = median(res.park_dirty) - median(res.other_alone)
            stored = f"{res.park_codec} {mb(res.park_stored)} MB"
            print(
                f"{res.n:6} {stored:>20} {median(res.resume) * ms:9.1f} {median(res.resident) * ms:11.1f} "
                f"{cost * ms:14.1f} {cost / median(res.prefill):12.4f} {median(res.park_dirty) * ms:13.1f} "
                f"{median(res.other_alone) * ms:8.1f} {park * ms:12.1f}"
            )
        print("  'park dirty' = a request on slot b right after one on slot a (a is dirty), so b's request evicts a,")
        print("  saving it to Redis first; 'alone' = the same request on b without an eviction")
    print()
    if 2000 in ratio:
        g = ratio[2000]
        print(f"goal restore / re-prefill < 0.05 at 2000 tokens: {g:.4f} -> {'MET' if g < 0.05 else 'NOT MET'}")
    print(quiet.summary())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="500,2000,4000", help="slot sizes (tokens)")
    ap.add_argument("--levels", default="1,3", help="zstd levels")
    ap.add_argument("--reps", type=int, default=3, help="measured reps (+1 warm-up for server paths)")
    ap.add_argument("--prefill-reps", type=int, default=2, help="measured re-prefills (long: tens of seconds)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--no-park", dest="park", action="store_false", help="skip step 6")
    ap.add_argument("--aof", action="store_true", help="run Redis with its append-only file (noisier figures)")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--keep-logs", action="store_true")
    add_gpu_args(ap)
    add_idle_args(ap)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    levels = [int(x) for x in args.levels.split(",")]
    if max(sizes) + 1 > args.ctx_size:
        ap.error("largest size + 1 exceeds --ctx-size")
    model = args.model or default_model()

    tmp = Path(tempfile.mkdtemp(prefix="bench-persist-"))
    # tests/redis_server.py runs Redis with an append-only file; its background rewrites (a forked
    # child) and the kernel's writeback of hundreds of MB compete for the cores and make every figure
    # after a save noisy, so it is off unless --aof (with appendfsync everysec no save waits for a fsync)
    redis = RedisServer(tmp / "redis", extra_args=[] if args.aof else ["--appendonly", "no"])
    servers: list[ServerProc] = []
    bench: Bench | None = None
    results: list[SizeResult] = []
    try:
        redis.start()
        store = RedisStore.from_url(redis.url, prefix="bench:")
        p1 = free_port()
        cmd1 = slotserve_cmd(
            p1, tmp / "state1", parallel=3, ctx_size=args.ctx_size, threads=args.threads, model=model,
            n_gpu_layers=args.n_gpu_layers,
            extra=["--no-persist"],
        )  # fmt: skip
        servers.append(ServerProc("slotserve", cmd1, p1, tmp / "slotserve.log"))
        if args.park:
            p2 = free_port()
            cmd2 = slotserve_cmd(
                p2, tmp / "state2", parallel=1, ctx_size=args.ctx_size, threads=args.threads, model=model,
                n_gpu_layers=args.n_gpu_layers,
                extra=["--redis-url", redis.url, "--key-prefix", "bench-park:"],
            )  # fmt: skip
            servers.append(ServerProc("slotserve-park", cmd2, p2, tmp / "slotserve-park.log"))
        for srv in servers:
            print(f"{srv.name} ready on :{srv.port} in {srv.wait_ready(httpx):.1f}s", flush=True)
        client = httpx.Client(timeout=None)
        pids = {"redis": redis.proc.pid} if redis.proc else {}
        for srv in servers:
            pids |= srv.pids()
        quiet = Quiet(args, pids)
        bench = Bench(args, client, quiet, store)
        bench.s1 = servers[0]
        bench.s2 = servers[1] if args.park else None
        bench.fingerprint = check(client.get(bench.s1.base + "/api/v1/model"), "model")["fingerprint"]
        bench.tok = http_tokenizer(client, bench.s1.base)
        for srv in servers:  # warm each server up once (first decodes, allocations); nothing measured
            bench.generate(srv.base, "warm-up", build_prompt(bench.tok, 64), 8)
            bench.action(srv.base, "warm-up", "erase")

        for n in sizes:
            res = SizeResult(n)
            results.append(res)
            blob, tokens = bench.real_state(res)
            print(
                f"[{n} tokens] slot filled in {res.fill_s * 1000:.0f} ms; SES1 {len(tokens)} tokens, "
                f"{mb(len(blob))} MB ({len(blob) / len(tokens) / 1024:.1f} KiB/token)",
                flush=True,
            )
            bench.codecs(res, blob, levels)
            bench.redis(res, blob, tokens)
            sizes_txt = ", ".join(f"{r.codec}-{r.level} {mb(r.size)} MB" for r in res.codecs if r.codec != "none")
            print(f"  codecs and Redis done: {sizes_txt}", flush=True)
            bench.engine(res, blob, tokens)
            if bench.s2 is not None:
                bench.park(res, blob, tokens)
        report(args, model, redis.url, results, quiet)
    finally:
        redis.stop()
        if bench is not None:
            bench.loop.close()
        stop_servers(servers, tmp, args.keep_logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
