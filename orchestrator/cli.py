"""``slotserve serve``: start the orchestrator (which spawns its engine worker); ``slotserve check``."""

from __future__ import annotations

import argparse
import socket
import sys

import msgspec
import uvicorn

from contract import settings as engine_settings
from contract.heap import keep_heap_mapped
from orchestrator.config import Settings
from orchestrator.engine_client.launch import WorkerOptions
from orchestrator.web.logfilter import uvicorn_log_config
from orchestrator.web.read_limits import limited_protocol
from orchestrator.web.ws_frames import ZeroCopyWebSocketProtocol


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
    engine_settings.add_arguments(s.add_argument_group("server"), cls=Settings)
    return p


def worker_options(a: argparse.Namespace) -> WorkerOptions:
    """The engine worker's options from parsed ``serve`` / ``check`` arguments."""
    return WorkerOptions(engine=engine_settings.from_args(a), connect=a.worker)


def settings_from_args(a: argparse.Namespace) -> Settings:
    """:class:`Settings` from parsed ``serve`` arguments (``msgspec.ValidationError`` for a value out of range)."""
    return engine_settings.from_args(a, Settings(worker=worker_options(a)), cls=Settings)


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
    try:
        settings = settings_from_args(args)
    except msgspec.ValidationError as exc:
        parser.error(f"server settings: {exc}")
    if settings.slot_save_path is not None:
        settings.slot_save_path.mkdir(parents=True, exist_ok=True)
    from orchestrator.app import build_authenticator, create_app

    try:
        auth = build_authenticator(settings)  # a bad keys file stops the start with its file and line
    except ValueError as exc:
        parser.error(str(exc))
    keep_heap_mapped()  # per-token attention frames received into mapped memory (contract/heap.py)
    config = uvicorn.Config(
        create_app(settings, auth=auth),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(),  # no query strings (api_key) in its log lines
        http=limited_protocol(settings.read_limits),  # header size, header and body read timeouts
        ws_max_size=4 * settings.max_body_bytes + (1 << 20),  # we answer PAYLOAD_TOO_LARGE ourselves
        # uvicorn's sans-I/O websockets protocol stops reading the socket after each message until the
        # app takes it, so a socket that ws.Inbox stops reading holds one message at most (the legacy
        # "websockets" protocol would queue ws_max_queue, 32, of up to ws_max_size each).
        # (orchestrator/web/ws_frames.py: that protocol, writing attention frames without its serializer's copies)
        ws=ZeroCopyWebSocketProtocol,
        timeout_graceful_shutdown=30,
        # Attention frames are float32 noise to deflate (ratio ~0.96 at ~27 ms per 540 KB frame):
        # never negotiate permessage-deflate, whatever the client offers.
        ws_per_message_deflate=False,
    )
    hosts = [h.strip() for h in settings.host.split(",") if h.strip()]
    server = uvicorn.Server(config)
    if len(hosts) > 1:  # llama-server's --host list: one listening socket per address
        server.run(sockets=[listen_socket(h, settings.port) for h in hosts])
    else:
        server.run()
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (an IPv4 or IPv6 address or a name) and ``port``; an IPv6
    one is IPv6-only, as llama-server binds ``::`` in a list (llama.cpp ``common/arg.cpp``, ``--host``)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(addr)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


if __name__ == "__main__":
    sys.exit(main())
