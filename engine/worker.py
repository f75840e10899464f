"""Engine worker process: owns the model and context, runs the decode loop, serves one orchestrator.

Entry point: ``python -m engine.worker --connect unix:/path.sock --settings JSON``
(the orchestrator spawns it and listens; the settings are :class:`contract.settings.EngineSettings`;
``--shm-fd N``: the shared region, inherited, tokens' tensors go through: :mod:`contract.shm`)
or ``--listen tcp:HOST:PORT --model PATH ...`` to run it standalone.  A reader thread
turns incoming frames into a queue; the main thread applies requests between decode
steps (:class:`Worker` dispatches them by type) and steps the
:class:`~engine.batcher.Batcher` while there is work.  The worker exits when its peer
closes the stream or its parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import queue
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import llama_cpp  # noqa: F401 - first of the native libraries, before numpy's (docs/hardware.md)
import msgspec

from contract import protocol as proto
from contract import settings
from contract.buffers import BufferPool
from contract.errors import ErrorCode
from contract.framing import RecvBuffer, parse_address
from contract.heap import keep_heap_mapped, trim_heap
from contract.settings import SPLIT_MODES, EngineSettings
from contract.shm import RegionWriter, SharedRegion
from engine import backend
from engine.batcher import Batcher
from engine.classifier import Classifier
from engine.engine import Engine
from engine.errors import EngineError
from engine.handlers import EngineHandlers, Handler
from engine.model import Model, default_model_path, init_backend
from engine.model_info import model_info
from engine.outbox import Outbox

log = logging.getLogger("slotserve.worker")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


IDLE_TRIM_S = 5.0
"""Seconds without a request or a generation after which the worker trims its heap (contract/heap.py)."""

COMMIT_DELAY_S = 0.05
"""Seconds an idle worker waits after a generation before writing its last token to the KV cache (a
decode step of its own): long enough for the strict commit's read of the state, which does not wait for
it (``ReadKV``), to come first; a request that comes later finds it written.  A new generation on the
sequence writes it at once (``Batcher.submit``), another's step batches it."""

Inbound = tuple[proto.Request, list[RecvBuffer]]
"""A request and its raw buffers, as the reader thread queues them."""


class Worker:
    """Serves requests from one socket on one :class:`Engine` (generation) or :class:`Classifier`.

    Requests are dispatched by type (:attr:`handlers`).  A classifier worker answers
    ``Classify``, ``Tokenize``, ``Detokenize`` and ``Shutdown``; a generation worker answers
    everything but ``Classify``; anything else gets ``Error(INVALID_REQUEST)``.
    """

    def __init__(self, engine: Engine | Classifier, sock: socket.socket, shared: SharedRegion | None = None) -> None:
        """``shared``: the region its orchestrator mapped too (``--shm-fd``): tokens' tensors go through it
        (:mod:`contract.shm`), inline when it has no room."""
        self.engine = engine
        self.sock = sock
        self.shared = RegionWriter(shared) if shared is not None else None
        self.outbox = Outbox(sock, self.shared)
        self.inbox: queue.Queue[Inbound | None] = queue.Queue()  # None: the peer is gone
        self.pool = BufferPool(keep=1)  # restore-state blobs land in memory already mapped
        self.running = True
        self.batcher: Batcher | None = None
        self.handlers: dict[type, Handler] = {
            proto.Tokenize: self._tokenize,
            proto.Detokenize: self._detokenize,
            proto.Shutdown: self._shutdown,
        }
        if isinstance(engine, Engine):
            self.batcher = Batcher(engine, self.send)
            self.handlers |= EngineHandlers(engine, self.batcher, self.send, self.shared).table()
        else:
            self.handlers[proto.Classify] = self._classify

    def send(
        self, msg: proto.Message, buffers: Sequence[proto.Buffer] = (), done: Callable[[], None] | None = None
    ) -> None:
        """Write one reply frame, whole, in order (thread-safe: a slot-file writer thread answers too); bulk
        buffers on the writer thread, ``done`` called once they are written (:class:`engine.outbox.Outbox`)."""
        self.outbox.send(msg, buffers, done)

    def _read(self) -> None:
        try:
            while True:
                msg, bufs = proto.recv_request(self.sock, self.pool)
                if isinstance(msg, proto.Release):  # frees room at once, whatever the decode loop does
                    if self.shared is not None:
                        self.shared.release(msg.offsets)
                    continue
                self.inbox.put((msg, bufs))
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
        try:
            self._loop(eng if isinstance(eng, Engine) else None)  # a classifier has no KV streams
        finally:  # what is queued (a shutdown's ``Stopped``) is written before the socket closes
            self.outbox.close()

    def _loop(self, gen: Engine | None) -> None:
        worked = False  # since the heap was last trimmed
        while self.running:
            block = not self.has_work()
            commits = block and self.batcher is not None and bool(self.batcher.commits)
            item: Inbound | Literal[False] | None  # False: the inbox is empty
            try:
                wait = COMMIT_DELAY_S if commits else IDLE_TRIM_S if block and worked else None
                due_in = gen.releases.next_in() if gen is not None and block else None
                if due_in is not None:  # wake for an emptied stream's release (engine/kv_release.py)
                    wait = due_in if wait is None else min(wait, due_in)
                item = self.inbox.get(block=block, timeout=wait)
            except queue.Empty:
                item = False
                if gen is not None and gen.releases.next_in() == 0:
                    gen.release_due()
                    continue
                if commits and self.batcher is not None:  # idle since a generation ended: its last token
                    self.batcher.flush()
                    continue
                if block:  # idle for IDLE_TRIM_S: give back what the last requests left on the heap
                    if gen is not None:  # and the KV pages of empty streams a K-shift wrote
                        gen.release_empty()
                    trim_heap()
                    worked = False
                    continue
            worked = True
            while item is not False:
                if item is None:
                    return
                self._handle(*item)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = False
            if self.running and self.batcher is not None and self.batcher.has_work():
                self.batcher.step()
            if gen is not None and not block:  # busy: emptied streams are given back on time too
                gen.release_due()

    def has_work(self) -> bool:
        """True while generations are active (a classifier answers each request at once)."""
        return self.batcher is not None and self.batcher.has_work()

    def _handle(self, msg: proto.Request, bufs: list[RecvBuffer]) -> None:
        try:
            handler = self.handlers.get(type(msg))
            if handler is None:
                kind = "classifier" if self.batcher is None else "generation"
                raise EngineError(ErrorCode.INVALID_REQUEST, f"a {kind} worker does not serve {type(msg).__name__}")
            handler(msg, bufs)
        except EngineError as exc:
            self.send(proto.Error(msg.req, exc.code, exc.message))
        except proto.ProtocolError as exc:  # a buffer that does not match its description
            self.send(proto.Error(msg.req, ErrorCode.INVALID_REQUEST, str(exc)))
        except Exception as exc:  # a bug must not take the worker down
            log.exception("request %s failed", msg)
            self.send(proto.Error(msg.req, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        finally:
            for buf in bufs:  # handlers keep no received buffer (a restore copies into the KV cache)
                self.pool.give(buf)

    def _tokenize(self, msg: proto.Tokenize, _: list[RecvBuffer]) -> None:
        model = self.engine.model
        ids = model.tokenize(msg.text, msg.add_special, msg.parse_special)
        self.send(proto.TokenizeResult(msg.req, ids, [model.pieces[t] for t in ids]))

    def _detokenize(self, msg: proto.Detokenize, _: list[RecvBuffer]) -> None:
        self.send(proto.DetokenizeResult(msg.req, self.engine.model.detokenize(msg.ids)))

    def _shutdown(self, msg: proto.Shutdown, _: list[RecvBuffer]) -> None:
        if self.batcher is not None:
            self.batcher.flush()
        self.running = False
        self.send(proto.Stopped(msg.req))

    def _classify(self, msg: proto.Classify, _: list[RecvBuffer]) -> None:
        eng = self.engine
        assert isinstance(eng, Classifier)
        ids = [eng.tokenize(t) for t in msg.texts]
        logits = eng.classify(ids)
        self.send(proto.Classified(msg.req, [len(i) for i in ids], proto.Tensor.of(logits, 0)), [logits.data])


def build_parser() -> argparse.ArgumentParser:
    """Command line of the worker: where its orchestrator is, and the engine settings
    (``--settings JSON``, as the orchestrator hands them, and/or every engine flag of
    :mod:`contract.settings`; a flag given beside ``--settings`` overrides it)."""
    p = argparse.ArgumentParser(prog="python -m engine.worker", description="slotserve engine worker")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", help="unix:/path or tcp:host:port of the orchestrator")
    where.add_argument("--listen", help="unix:/path or tcp:host:port to accept one orchestrator on")
    p.add_argument("--settings", type=settings.decode, default=None, help="the engine settings as JSON, whole")
    p.add_argument(
        "--shm-fd", type=int, default=None, help="descriptor of the shared region the spawning orchestrator mapped"
    )
    settings.add_arguments(p.add_argument_group("engine"))
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineSettings]:
    """The worker's parsed command line and the engine settings it gives (exits 2 on a bad value)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args, settings.from_args(args, args.settings)
    except msgspec.ValidationError as exc:
        parser.error(str(exc))


def open_socket(args: argparse.Namespace) -> socket.socket:
    """Connect to, or accept, the orchestrator."""
    if args.connect:
        family, addr = parse_address(args.connect)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.connect(addr)
        return sock
    family, addr = parse_address(args.listen)
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(addr)
    srv.listen(1)
    conn, _ = srv.accept()
    srv.close()
    return conn


def run_worker_process(argv: list[str] | None = None) -> int:
    """Process entry: reach the orchestrator, load the model and the engine (or the classifier), serve.

    The socket is opened first so that the orchestrator learns every start-up stage
    (:class:`contract.protocol.Starting`) and, if the process dies on the way (a crash in
    native code), which stage it reached.
    """
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    keep_heap_mapped()  # per-token attention arrays from mapped memory (contract/heap.py)
    args, config = parse_args(argv)
    sock = open_socket(args)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    try:
        engine = start_engine(
            config, lambda stage, fraction=0.0: proto.send_frame(sock, proto.Starting(0, stage, fraction))
        )
        shared = SharedRegion.attach(args.shm_fd) if args.shm_fd is not None else None
        try:
            Worker(engine, sock, shared).serve()
        finally:
            engine.close()
            engine.model.close()
    finally:
        sock.close()
    return 0


def start_engine(config: EngineSettings, report: Callable[..., None]) -> Engine | Classifier:
    """Load the model and build the :class:`Engine` (or, with ``config.classifier``, the
    :class:`~engine.classifier.Classifier`) for ``config``.

    ``report(stage, fraction=0.0)`` is called as each start-up stage begins and with the
    model load's progress (at most every 5 %).  Extra buffer types follow
    :func:`engine.backend.choose_repack` (``repack`` True / False, else auto).
    """
    init_backend()
    choice = backend.choose_repack(config.repack, backend.cpu_extra_bufts())
    log.info("CPU weight repacking %s: %s", "on" if choice.use_extra_bufts else "off", choice.reason)
    last = [-1.0]

    def progress(fraction: float) -> None:
        if fraction - last[0] >= 0.05 or fraction >= 1.0:
            last[0] = fraction
            report("loading_model", fraction)

    report("loading_model", 0.0)
    model = Model(
        Path(config.model) if config.model else default_model_path(),
        n_gpu_layers=config.n_gpu_layers,
        repack=choice,
        on_progress=progress,
        placement=backend.Placement(
            devices=config.device,
            split_mode=SPLIT_MODES[config.split_mode],
            main_gpu=config.main_gpu,
            tensor_split=config.tensor_split_values,
        ),
    )
    try:
        if config.classifier or config.embedder:
            report("creating_context")
            return Classifier(model, config.n_threads, embed=config.embedder)
        log_kv_cache(config, model)
        return Engine(model, config, on_stage=report)
    except BaseException:
        model.close()
        raise


def log_kv_cache(config: EngineSettings, model: Model) -> None:
    """Log the KV cache's size against the model's trained context."""
    if config.n_ctx > model.n_ctx_train:
        log.warning("each slot's window (%d tokens) exceeds the trained context (%d)", config.n_ctx, model.n_ctx_train)
    log.info(
        "KV cache: %d sequences (%d slots, %d spares), each in a KV stream of %d cells (trained context: %d)",
        config.n_seq_max,
        config.n_slots,
        config.n_spare,
        config.n_ctx_seq,
        model.n_ctx_train,
    )


if __name__ == "__main__":
    sys.exit(run_worker_process())
