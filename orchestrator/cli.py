"""``slotserve serve``: start the orchestrator (which spawns its engine worker); ``slotserve check``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec
import uvicorn

from engine import settings as engine_settings
from engine.heap import keep_heap_mapped
from engine.settings import EngineSettings
from orchestrator.config import Settings
from orchestrator.logfilter import uvicorn_log_config
from orchestrator.worker_options import WorkerOptions


def build_parser() -> argparse.ArgumentParser:
    """The ``slotserve`` command line (llama-server / KoboldCpp style names)."""
    p = argparse.ArgumentParser(prog="slotserve", description="Attention-streaming llama.cpp server with KV slots")
    sub = p.add_subparsers(dest="command", required=True)
    eng = argparse.ArgumentParser(add_help=False)
    engine_settings.add_arguments(eng.add_argument_group("engine"), serve=True)
    eng.add_argument(
        "--worker", default=None, help="tcp:HOST:PORT of a standalone engine worker instead of spawning one"
    )
    sub.add_parser(
        "check",
        parents=[eng],
        help="check the engine on this machine (start-up, attention vs a fresh prefill); exit 1 on failure",
    )
    s = sub.add_parser("serve", parents=[eng], help="run the HTTP/WebSocket server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5001)
    s.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"), help="require this key (Bearer)")
    s.add_argument(
        "--admin-key", default=os.environ.get("SLOTSERVE_ADMIN_KEY"), help="guards /admin and slot-changing actions"
    )
    s.add_argument("--no-slots", action="store_true", help="turn off the GET /slots listing (llama-server's)")
    s.add_argument("--max-body", type=int, default=64 << 20, help="max JSON body / WebSocket message, bytes")
    s.add_argument(
        "--allowed-origins",
        "--cors-origin",
        action="append",
        default=None,
        help="web origins allowed to call the API, HTTP (CORS) and WebSocket alike; comma-separated or repeated"
        " (default *: any page)",
    )
    s.add_argument("--slot-save-path", type=Path, default=None, help="directory of the save/restore file actions")
    s.add_argument("--state-dir", type=Path, default=None, help="embedded store directory (default ~/.local/state)")
    s.add_argument(
        "--redis-url", default=os.environ.get("SLOTSERVE_REDIS_URL"), help="redis://, rediss://, sentinel, cluster"
    )
    s.add_argument("--key-prefix", default="slotserve:")
    s.add_argument("--state-ttl", type=int, default=None, help="expire stored slots after N seconds idle")
    s.add_argument("--chunk-bytes", type=int, default=64 << 20, help="split stored blobs into chunks of this size")
    s.add_argument("--codec", default="auto", help="auto, best, zstd, zstd-planes, none")
    s.add_argument("--codec-level", type=int, default=3)
    s.add_argument("--no-persist", action="store_true", help="no store: slots live only in the engine")
    s.add_argument("--node-id", default="", help="this node's name in slot leases (default host:port)")
    s.add_argument("--lease-ms", type=int, default=6_000, help="slot lease time-to-live, ms (renewed every third)")
    s.add_argument("--park-idle", type=float, default=600.0, help="park slots idle this many seconds (0: never)")
    s.add_argument(
        "--n-predict", "-n", type=int, default=-1, help="default tokens per /completion (-1: up to the window)"
    )
    s.add_argument(
        "--slot-wait", type=float, default=300.0, help="seconds a request waits for a busy slot before SLOT_BUSY"
    )
    s.add_argument(
        "--queue-size", type=int, default=64, help="requests that may wait for a free engine sequence (0: 429 at once)"
    )
    s.add_argument("--queue-timeout", type=float, default=300.0, help="longest wait for an engine sequence, seconds")
    s.add_argument("--store-timeout", type=float, default=3.0, help="deadline of one state-store call, seconds")
    s.add_argument(
        "--durability",
        choices=("strict", "write-behind"),
        default="strict",
        help="strict: a turn is answered once its state is stored; write-behind: answered at once, stored after"
        " --write-delay-ms (a crash loses the turns of that window)",
    )
    s.add_argument("--write-delay-ms", type=int, default=200, help="write-behind: wait this long to coalesce saves, ms")
    s.add_argument("--classifier-model", default=None, help="classifier GGUF (pooling rank) served by POST /classify")
    s.add_argument("--log-level", default="info")
    return p


def worker_options(a: argparse.Namespace) -> WorkerOptions:
    """The engine worker's options from parsed ``serve`` / ``check`` arguments."""
    return WorkerOptions(engine=engine_settings.from_args(a), connect=a.worker)


def settings_from_args(a: argparse.Namespace) -> Settings:
    """:class:`Settings` from parsed ``serve`` arguments."""
    worker = worker_options(a)
    classifier = None
    if a.classifier_model is not None:
        engine = worker.engine
        classifier = WorkerOptions(
            EngineSettings(model=a.classifier_model, n_threads=engine.n_threads, repack=engine.repack, classifier=True)
        )
    return Settings(
        worker=worker,
        classifier=classifier,
        host=a.host,
        port=a.port,
        api_key=a.api_key or None,
        admin_key=a.admin_key or None,
        slots_endpoint=not a.no_slots,
        max_body_bytes=a.max_body,
        allowed_origins=tuple(o.strip() for v in a.allowed_origins or ["*"] for o in v.split(",") if o.strip()),
        slot_save_path=a.slot_save_path,
        state_dir=a.state_dir,
        redis_url=a.redis_url or None,
        key_prefix=a.key_prefix,
        state_ttl_s=a.state_ttl,
        chunk_bytes=a.chunk_bytes,
        codec=a.codec,
        codec_level=a.codec_level,
        persist=not a.no_persist,
        node_id=a.node_id,
        lease_ms=a.lease_ms,
        park_idle_s=a.park_idle,
        slot_wait_s=a.slot_wait,
        n_predict=a.n_predict,
        queue_size=a.queue_size,
        queue_timeout_s=a.queue_timeout,
        store_timeout_s=a.store_timeout,
        durability=a.durability,
        write_delay_ms=a.write_delay_ms,
    )


def main(argv: list[str] | None = None) -> int:
    """Console script entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine_settings.from_args(args)
    except msgspec.ValidationError as exc:
        parser.error(f"engine settings: {exc}")
    if args.command == "check":
        from orchestrator.check import main as check_main

        return check_main(worker_options(args))
    settings = settings_from_args(args)
    if settings.slot_save_path is not None:
        settings.slot_save_path.mkdir(parents=True, exist_ok=True)
    from orchestrator.app import create_app

    keep_heap_mapped()  # per-token attention frames received into mapped memory (engine/heap.py)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        log_config=uvicorn_log_config(),  # no query strings (api_key) in its log lines
        ws_max_size=4 * settings.max_body_bytes + (1 << 20),  # we answer PAYLOAD_TOO_LARGE ourselves
        timeout_graceful_shutdown=30,
        # Attention frames are float32 noise to deflate (ratio ~0.96 at ~27 ms per 540 KB frame):
        # never negotiate permessage-deflate, whatever the client offers.
        ws_per_message_deflate=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
