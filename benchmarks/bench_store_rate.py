"""KV chunks into and out of the slot stores, in process: the effective rate of a whole state's save and load.

A stored slot is a manifest of KV chunks (docs/operations.md, "Incremental states"); restoring a parked or
restarted conversation reads all of its chunks (``ChunkStore.get_chunks``), and its first save, or a save
after a truncation, writes all of them (``put_chunks``).  This times both through the stores the server uses
(``storage.redis_store.RedisStore`` on a throw-away ``redis-server`` without its append-only file, and
``storage.directory.DirectoryStore`` with its fsync), on the event loop the server runs (uvloop, as uvicorn
picks when it is installed; ``--loop asyncio`` for the standard one), for a state of ``--mb`` MB in chunks of
``--chunk-mb`` MB (defaults: 92 MB, SmolLM2-135M's f16 KV at 4,000 tokens, in its 256-position chunks of
about 5.9 MB).  The chunk bytes are random (the store neither compresses nor reads them).  Printed: median and
best of ``--reps`` in ms and GB/s (10^9 bytes per second); issue 33's goal for Redis is >= 1 GB/s.  Each put
first drops the chunks, so it writes every byte.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_store_rate.py [--store redis|dir|both] [--mb 92]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from common import load, machine

from contract.heap import keep_heap_mapped
from storage.base import CHUNK_KEY_HEX
from storage.directory import DirectoryStore
from storage.redis_store import RedisStore
from tests.redis_server import RedisServer


async def timed(
    reps: int, run: Callable[[], Awaitable[object]], prepare: Callable[[], Awaitable[object]] | None = None
) -> list[float]:
    """Seconds of each of ``reps`` awaits of ``run()``, each after an untimed ``prepare()`` when given."""
    out = []
    for _ in range(reps):
        if prepare:
            await prepare()
        t0 = time.perf_counter()
        await run()
        out.append(time.perf_counter() - t0)
    return out


async def rates(store: RedisStore | DirectoryStore, chunks: dict[str, bytes], reps: int) -> dict[str, list[float]]:
    """Seconds per put and per get of every chunk of ``chunks`` through ``store``."""
    keys = list(chunks)
    total = sum(len(v) for v in chunks.values())

    async def drop() -> None:
        await store.drop_chunks(keys)

    async def get() -> None:
        got = await store.get_chunks(keys, total)
        if any(g is None or len(g) != len(chunks[k]) for k, g in zip(keys, got, strict=True)):
            raise RuntimeError("a chunk came back missing or of another size")

    out = {"put": await timed(reps, lambda: store.put_chunks(chunks), prepare=drop)}
    out["get"] = await timed(reps, get)
    await drop()
    return out


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    n = max(1, round(args.mb / args.chunk_mb))
    size = int(args.chunk_mb * 1e6)
    chunks = {f"{i:0{CHUNK_KEY_HEX}x}": os.urandom(size) for i in range(n)}
    total = n * size
    print(f"{n} chunks of {size / 1e6:.1f} MB = {total / 1e6:.1f} MB; event loop: {args.loop}; {load()}")
    stores: list[tuple[str, RedisStore | DirectoryStore]] = []
    redis = None
    if args.store in ("redis", "both"):
        redis = RedisServer(tmp / "redis", extra_args=["--appendonly", "no"])
        redis.start()
        stores.append(("Redis (local TCP)", RedisStore.from_url(redis.url, prefix="bench-rate:")))
    if args.store in ("dir", "both"):
        stores.append(("directory (fsync)", DirectoryStore(tmp / "dir")))
    try:
        for name, store in stores:
            got = await rates(store, chunks, args.reps)
            for op, secs in got.items():
                med = statistics.median(secs)
                print(
                    f"{name:18} {op}: median {med * 1e3:7.1f} ms = {total / med / 1e9:5.2f} GB/s"
                    f" (best {total / min(secs) / 1e9:.2f})"
                )
            await store.close()
    finally:
        if redis:
            redis.stop()
    print(f"at the end: {load()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=("redis", "dir", "both"), default="both")
    ap.add_argument("--mb", type=float, default=92.0, help="the state's size in MB")
    ap.add_argument("--chunk-mb", type=float, default=5.9, help="one chunk's size in MB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--glibc-heap", action="store_true", help="leave glibc's mmap and trim thresholds at its defaults")
    args = ap.parse_args()
    print(machine())
    if not args.glibc_heap:
        mapped = keep_heap_mapped()
        print(f"heap thresholds as the server's (contract/heap.py): {'set' if mapped else 'refused by mallopt'}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-rate-"))
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main_async(args, tmp))
    else:
        asyncio.run(main_async(args, tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
