"""A generation worker's request handlers: one per message of :mod:`contract.protocol`.

:class:`EngineHandlers` maps each request type the generation worker serves to the
method that answers it (SGLang's type-based dispatch): adding a message is one Struct
and one row.  Handlers run on the worker's loop thread, between decode steps, and
raise :class:`engine.errors.EngineError` to answer ``Error``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.framing import RecvBuffer
from contract.shm import RegionWriter
from engine.batcher import Batcher
from engine.engine import Engine
from engine.errors import EngineError
from engine.kv_range import read_ranges
from engine.state_file import load_seq_file, write_slot_file


class Send(Protocol):
    """Writes one reply frame (:meth:`engine.worker.Worker.send`); ``done`` is called once its buffers are written."""

    def __call__(
        self, msg: proto.Message, buffers: Sequence[proto.Buffer], done: Callable[[], None] | None = None
    ) -> None: ...


Handler = Callable[[Any, list[RecvBuffer]], None]


class EngineHandlers:
    """Answers generation and KV-sequence requests on one :class:`Engine` through its :class:`Batcher`."""

    def __init__(self, engine: Engine, batcher: Batcher, send: Send, shared: RegionWriter | None = None) -> None:
        """``shared``: the region token tensors go through (:mod:`contract.shm`), reported by ``Status``."""
        self.engine = engine
        self.batcher = batcher
        self.send = send
        self.shared = shared

    def table(self) -> dict[type, Handler]:
        """Request type -> handler."""
        return {
            proto.Generate: lambda msg, _: self.batcher.submit(msg),
            proto.Cancel: lambda msg, _: self.batcher.cancel(msg.target),
            proto.Ack: lambda msg, _: self.batcher.ack(msg.target, msg.n),
            proto.Status: self.status,
            proto.CheckSampling: self.check_sampling,
            proto.Tokens: self.sequence(lambda msg: None),
            proto.Erase: self.sequence(lambda msg: self.engine.erase(msg.seq)),
            proto.Truncate: self.sequence(lambda msg: self.engine.truncate(msg.seq, msg.n_keep)),
            proto.Fork: self.fork,
            proto.ContextShift: self.sequence(
                lambda msg: self.engine.context_shift(msg.seq, msg.n_keep, msg.n_discard)
            ),
            proto.SaveState: self.save_state,
            proto.ReadKV: self.read_kv,
            proto.RestoreState: self.restore_state,
            proto.SaveFile: self.save_file,
            proto.LoadFile: self.load_file,
        }

    def check(
        self, msg: proto.SeqRequest, seq: int | None = None, writes: bool | None = None, flush: bool = True
    ) -> None:
        """Refuse a sequence that is not a slot's (``INVALID_REQUEST``) or, for a request that
        writes, one a generation owns (``SLOT_BUSY``); then (``flush``) write its pending last token."""
        seq = msg.seq if seq is None else seq
        if not 0 <= seq < self.engine.config.n_slots:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"no engine sequence {seq}")
        if (msg.writes if writes is None else writes) and self.batcher.busy(seq):
            raise EngineError(ErrorCode.SLOT_BUSY, f"sequence {seq} is generating")
        if flush:
            self.batcher.flush(seq)

    def sequence(self, op: Callable[[Any], object]) -> Handler:
        """The handler of an operation on ``msg.seq`` that answers the sequence's tokens (``SeqTokens``)."""

        def handle(msg: proto.SeqRequest, _: list[RecvBuffer]) -> None:
            self.check(msg)
            op(msg)
            self.send(proto.SeqTokens(msg.req, msg.seq, list(self.engine.tokens.get(msg.seq, []))), ())

        return handle

    def status(self, msg: proto.Status, _: list[RecvBuffer]) -> None:
        """Which sequences generate, and the shared region's use."""
        busy = sorted({j.seq for j in self.batcher.jobs.values() if not j.fork})
        w = self.shared
        shm = (w.region.size, w.ranges.free_bytes, w.shared, w.inline) if w is not None else (0, 0, 0, 0)
        self.send(proto.EngineState(msg.req, busy, *shm), ())

    def check_sampling(self, msg: proto.CheckSampling, _: list[RecvBuffer]) -> None:
        """Build ``msg.params``' sampler chain and free it (``INVALID_GRAMMAR`` when it cannot be built)."""
        self.batcher.new_chain(msg.params).close()
        self.send(proto.SamplingChecked(msg.req), ())

    def fork(self, msg: proto.Fork, _: list[RecvBuffer]) -> None:
        """Copy-on-write copy of ``seq`` into ``target`` (which must not be generating)."""
        self.check(msg)
        self.check(msg, msg.target, writes=True)
        self.engine.fork(msg.seq, msg.target)
        self.send(proto.SeqTokens(msg.req, msg.target, list(self.engine.tokens.get(msg.target, []))), ())

    def save_state(self, msg: proto.SaveState, _: list[RecvBuffer]) -> None:
        """The sequence's tokens and llama.cpp state (buffer 0)."""
        self.check(msg)
        t0 = time.perf_counter()
        tokens, blob = self.engine.save_state(msg.seq)
        t_ms = (time.perf_counter() - t0) * 1000
        # written by the worker's writer thread while the others decode; no copy is kept once it is
        # written or dropped (engine/engine.py, save_state)
        reply = proto.StateBlob(msg.req, msg.seq, tokens, t_ms, proto.Tensor.raw(blob))
        self.send(reply, [blob], lambda: self.engine.release_state(blob))

    def read_kv(self, msg: proto.ReadKV, _: list[RecvBuffer]) -> None:
        """The tokens whose KV is in the sequence (its pending last token left unwritten) and the KV records
        of ``msg.ranges`` (buffers 0..n-1)."""
        self.check(msg, flush=False)
        t0 = time.perf_counter()
        records = read_ranges(self.engine.ctx, msg.seq, [(r.cache, r.p0, r.p1) for r in msg.ranges])
        t_ms = (time.perf_counter() - t0) * 1000
        tokens = list(self.engine.tokens.get(msg.seq, []))
        descs = [proto.Tensor.raw(rec, i) for i, rec in enumerate(records)]
        self.send(proto.KVRecords(msg.req, msg.seq, tokens, t_ms, descs), records)

    def restore_state(self, msg: proto.RestoreState, bufs: list[RecvBuffer]) -> None:
        """Replace the sequence from tokens + the llama.cpp state the message describes."""
        if msg.state.dtype != "uint8" or len(msg.state.shape) != 1:
            raise EngineError(ErrorCode.BAD_STATE, f"a state is uint8[n] bytes, not {msg.state.dtype}{msg.state.shape}")
        state = msg.state.take(bufs)
        self.check(msg)
        t0 = time.perf_counter()
        self.engine.restore_state(msg.seq, msg.tokens, memoryview(state), check_values=True)
        t_ms = (time.perf_counter() - t0) * 1000
        self.send(proto.StateRestored(msg.req, msg.seq, len(msg.tokens), t_ms), ())

    def save_file(self, msg: proto.SaveFile, _: list[RecvBuffer]) -> None:
        """Write the sequence as llama-server's slot file on a writer thread
        (:func:`engine.state_file.write_slot_file`), which answers when the file is in place."""
        self.check(msg)
        t0 = time.perf_counter()
        tokens, state = self.engine.save_state(msg.seq)

        def write() -> None:
            reply: proto.Message
            try:
                n = write_slot_file(Path(msg.path), tokens, state)
                reply = proto.FileSaved(msg.req, msg.seq, len(tokens), n, (time.perf_counter() - t0) * 1000)
            except EngineError as exc:
                reply = proto.Error(msg.req, exc.code, exc.message)
            finally:
                self.engine.release_state(state)
            self.send(reply, ())

        # not a daemon: a worker asked to stop still finishes the file (and renames it) first
        threading.Thread(target=write, name=f"slot-file-{msg.req}").start()

    def load_file(self, msg: proto.LoadFile, _: list[RecvBuffer]) -> None:
        """Replace the sequence from a slot file (:func:`engine.state_file.load_seq_file`)."""
        self.check(msg)
        n, size, t_ms = load_seq_file(self.engine, msg.seq, Path(msg.path))
        self.send(proto.StateRestored(msg.req, msg.seq, n, t_ms, size), ())
