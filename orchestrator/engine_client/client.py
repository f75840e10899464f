"""The orchestrator's handle on an engine worker process: :class:`WorkerClient`.

:class:`WorkerClient` implements :class:`orchestrator.engine_client.interface.EngineClient` over a worker
process: it spawns ``python -m engine.worker`` (or connects to a standalone one), speaks
:mod:`contract.protocol` over a socket, and demultiplexes replies to the requests that are
waiting for them.  Nothing here loads llama.cpp: the API process imports only the
protocol's messages.  The process itself is :mod:`orchestrator.engine_client.launch`; the table of requests
waiting for replies, and how a reply becomes a result or a generation's events, is
:mod:`orchestrator.engine_client.replies`.

If the worker dies, every pending request fails with ``EngineDeadError`` (an error
event for streams) and, when ``restart`` is on, a new worker is started; its
sequences are empty, so slots must come back from the store (``on_restart`` hook).

Flow control: every ``Generate`` carries the client's ``window`` (tokens) and ``window_bytes``
(tensor bytes; :mod:`contract.flow`, ``--stream-window`` and ``--stream-window-bytes``), and the
stream sends ``Ack(target=req, n)`` as its consumer takes tokens
(:class:`orchestrator.engine_client.interface.GenerationStream`), so a request's reply queue holds at most
that many tokens (and about that many bytes of attention) however slowly its client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import msgspec
import structlog

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.flow import WINDOW_BYTES, WINDOW_TOKENS
from contract.framing import RECEIVE_POOL, FrameStream, RecvBuffer, open_frame_stream, parse_address
from contract.options import CaptureOptions, SamplingParams
from orchestrator.engine_client.interface import (
    Classification,
    EngineDeadError,
    EngineRequestError,
    GenerationJob,
    GenerationStream,
    SequenceKV,
    SequenceState,
)
from orchestrator.engine_client.launch import EngineStartError, WorkerOptions, WorkerProcess, describe_exit
from orchestrator.engine_client.replies import (
    Event,
    PendingReplies,
    drain_to_end,
    generation_events,
    single_reply,
)

log = structlog.get_logger("slotserve.engine")
R = TypeVar("R", bound=proto.Message)


class WorkerClient:
    """Async client of one engine worker, an :class:`orchestrator.engine_client.interface.EngineClient`.

    See the module docstring.
    """

    def __init__(
        self,
        options: WorkerOptions,
        restart: bool = True,
        window: int = WINDOW_TOKENS,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        """``window`` / ``window_bytes``: the flow-control window of every generation, in tokens and
        in tensor bytes (:mod:`contract.flow`; 0 turns a bound off, both 0: unbounded and no ``Ack``).
        Past it the worker holds the sequence (``Batcher.held``; the other sequences go on) until an
        ``Ack`` or a cancel, so the memory of a stream here is at most that window plus the frame
        being sent (docs/operations.md, "Memory per client")."""
        self.options = options
        self.restart = restart
        self.window = window
        self.window_bytes = window_bytes
        self.info: proto.ModelInfo | None = None
        self.pieces: list[bytes] = []
        self.generation = 0  # incremented on every (re)start: sequences of older generations are gone
        self.on_restart: Callable[[], Awaitable[None]] | None = None
        self._ids = itertools.count(1)
        self._pending = PendingReplies()
        self._stream: FrameStream | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._process: WorkerProcess | None = None
        self._closing = False
        self._ready = asyncio.Event()
        self.stage = "not started"  # start-up stage reached (contract.protocol.Starting), "ready" once up
        self.load_fraction = 0.0  # model load progress while stage == "loading_model"
        self._write_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        """True while a worker is connected and ready."""
        return self._ready.is_set()

    @property
    def pid(self) -> int | None:
        """The spawned worker's process id."""
        return self._process.pid if self._process else None

    async def start(self, timeout: float = 300.0) -> proto.ModelInfo:
        """Start (or connect to) the worker and wait for its ``Ready``.

        ``timeout`` (s) bounds each wait: the connection, and every start-up stage
        (:class:`contract.protocol.Starting`).  When a spawned worker crashes (dies by a
        signal) during start-up with CPU weight repacking left to auto, it is started
        once more with repacking off, and a warning says so.  Raises
        :class:`EngineStartError` (stage reached, exit status) when the worker fails.
        """
        try:
            return await self._start_once(timeout)
        except EngineStartError as exc:
            if not (exc.crashed and self.options.connect is None and self.options.engine.repack is None):
                raise
            log.warning(
                "engine worker crashed during start-up; retrying once without CPU weight repacking",
                stage=exc.stage,
                signal=signal.Signals(-exc.returncode).name if exc.returncode else None,
                gives_up="llama.cpp's extra buffer types (repacked CPU weights: faster prefill on some CPUs)",
            )
            self.options = replace(self.options, engine=msgspec.structs.replace(self.options.engine, repack=False))
            return await self._start_once(timeout)

    async def _start_once(self, timeout: float) -> proto.ModelInfo:
        self.stage = "connecting"
        self.load_fraction = 0.0
        if self.options.connect:
            family, addr = parse_address(self.options.connect)
            stream = await open_frame_stream(family, addr)
        else:
            self.stage = "spawning"
            self._process = WorkerProcess(self.options)
            stream = await self._process.spawn(timeout)
        try:
            reply = await self._await_ready(stream, timeout)
        except BaseException:
            stream.close()
            await self._teardown()
            raise
        self.stage = "ready"
        self.info = reply.info
        self.pieces = reply.pieces
        self._stream = stream
        self.generation += 1
        self._reader_task = asyncio.create_task(self._read_loop(stream), name="engine-reader")
        self._ready.set()
        rt = reply.info.runtime
        log.info(
            "engine ready",
            model=reply.info.model_name,
            pid=self.pid,
            generation=self.generation,
            backend=rt.backend,
            layers_offloaded=rt.n_layers_offloaded,
            repack=rt.use_extra_bufts,
            repack_reason=rt.repack_reason,
            capture=rt.capture,
            flash_attn=rt.flash_attn,
            threads=rt.n_threads,
        )
        return reply.info

    async def _await_ready(self, stream: FrameStream, timeout: float) -> proto.Ready:
        """Follow the worker's :class:`contract.protocol.Starting` reports until ``Ready``."""
        while True:
            try:
                reply, _ = await asyncio.wait_for(proto.read_reply(stream), timeout)
            except (ConnectionError, TimeoutError, proto.ProtocolError) as exc:
                code = await self._process.exit_status() if self._process is not None else None
                what = f"died with {describe_exit(code)}" if code is not None else f"stopped answering ({exc!r})"
                log.error("engine worker failed during start-up", stage=self.stage, exit=describe_exit(code))
                raise EngineStartError(f"worker {what} during stage {self.stage!r}", self.stage, code) from exc
            if isinstance(reply, proto.Ready):
                return reply
            if isinstance(reply, proto.Starting):
                if reply.stage != self.stage:
                    log.info("engine starting", stage=reply.stage)
                self.stage, self.load_fraction = reply.stage, reply.fraction
                continue
            raise EngineStartError(f"worker sent {type(reply).__name__} before Ready", self.stage, None)

    async def close(self) -> None:
        """Ask the worker to finish (flushing its commits) and stop it."""
        self._closing = True
        if self.alive:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._request(proto.Shutdown(self.new_id()), proto.Stopped), 10)
        await self._teardown()

    async def _teardown(self) -> None:
        self._ready.clear()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._process is not None:
            await self._process.stop()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()

    async def _read_loop(self, stream: FrameStream) -> None:
        try:
            while True:
                msg, bufs = await proto.read_reply(stream)
                self._pending.deliver(msg, bufs)
        except (ConnectionError, proto.ProtocolError) as exc:
            if not self._closing:
                log.error("engine worker connection lost", error=str(exc), pid=self.pid)
        finally:
            self._ready.clear()
            self._pending.fail_all()
            if not self._closing:
                await self._teardown()
                if self.restart:
                    asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        delay = 0.5
        while not self._closing:
            try:
                await self.start()
                if self.on_restart is not None:
                    await self.on_restart()
                return
            except Exception as exc:
                log.error("engine restart failed", error=str(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until a worker is ready (after a restart); False on timeout."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------------ requests

    async def _send(self, msg: proto.Message, buffers: Sequence[proto.Buffer] = ()) -> None:
        if not self.alive or self._stream is None:
            raise EngineDeadError("the engine worker is not running")
        async with self._write_lock:
            try:
                self._stream.write(proto.encode_frame(msg, buffers))
                await self._stream.drain()
            except proto.ProtocolError as exc:
                raise EngineDeadError(f"the engine worker connection is closed: {exc}") from exc

    def new_id(self) -> int:
        """A fresh request id."""
        return next(self._ids)

    async def _request(
        self, msg: proto.Message, answer: type[R], buffers: Sequence[proto.Buffer] = ()
    ) -> tuple[R, list[RecvBuffer]]:
        """Send ``msg`` and return its single reply, an ``answer`` (:func:`single_reply`: raises
        :class:`EngineRequestError` on ``Error``, :class:`EngineDeadError` when the worker dies)."""
        q = self._pending.open(msg.req)
        try:
            await self._send(msg, buffers)
            item = await q.get()
        finally:
            self._pending.close(msg.req)
        return single_reply(item, msg, answer)

    async def _open_stream(self, msg: proto.Generate) -> GenerationStream:
        """Send a ``Generate`` now; return the stream of its events (the worker has the request on return)."""
        q = self._pending.open(msg.req)
        try:
            await self._send(msg)
        except BaseException:
            self._pending.close(msg.req)
            raise
        ack = (lambda n: self._ack(msg.req, n)) if msg.window > 0 or msg.window_bytes > 0 else None
        abandon = functools.partial(self._abandon, msg.req, q)
        events = generation_events(q, abandon, functools.partial(self._pending.close, msg.req))
        return GenerationStream(msg.req, events, abandon, ack, msg.window, msg.window_bytes)

    async def _ack(self, req: int, n: int) -> None:
        """Tell the worker the client of generation ``req`` has taken its first ``n`` tokens.

        A dead worker is not an error here: the stream's next event reports it."""
        with contextlib.suppress(EngineDeadError):
            await self._send(proto.Ack(self.new_id(), req, n))

    async def _abandon(self, req: int, q: asyncio.Queue[Event | None]) -> None:
        """Cancel generation ``req`` and wait for its end (up to 30 s), even if the caller is cancelled."""
        if self.alive:
            await asyncio.shield(self._cancel_and_drain(req, q))
        self._pending.close(req)

    async def _cancel_and_drain(self, req: int, q: asyncio.Queue[Event | None]) -> None:
        with contextlib.suppress(Exception):
            await self._send(proto.Cancel(self.new_id(), req))
            await drain_to_end(q)

    # ------------------------------------------------------------------ the EngineClient protocol

    async def generate(self, job: GenerationJob) -> GenerationStream:
        """See :meth:`orchestrator.engine_client.interface.EngineClient.generate`."""
        msg = proto.Generate(
            self.new_id(), job.seq, "generate", list(job.input_ids), job.params, job.capture, progress=job.progress,
            window=self.window, window_bytes=self.window_bytes, cache_reuse=job.cache_reuse, n_keep=job.n_keep,
            n_discard=job.n_discard,
        )  # fmt: skip
        return await self._open_stream(msg)

    async def preview(
        self,
        seq: int | None,
        input_ids: Sequence[int],
        append: Sequence[int],
        params: SamplingParams,
        capture: CaptureOptions,
    ) -> GenerationStream:
        """See :meth:`orchestrator.engine_client.interface.EngineClient.preview`."""
        at = -1 if seq is None else seq
        msg = proto.Generate(
            self.new_id(), at, "preview", list(input_ids), params, capture, list(append),
            window=self.window, window_bytes=self.window_bytes,
        )  # fmt: skip
        return await self._open_stream(msg)

    async def cancel(self, req: int) -> None:
        """Ask the worker to cancel generation ``req`` (no reply; its stream ends with ``Done``)."""
        await self._send(proto.Cancel(self.new_id(), req))

    async def _seq_tokens(self, msg: proto.SeqRequest) -> list[int]:
        reply, _ = await self._request(msg, proto.SeqTokens)
        return reply.tokens

    async def tokens(self, seq: int) -> list[int]:
        """The tokens whose KV is in ``seq``, in position order."""
        return await self._seq_tokens(proto.Tokens(self.new_id(), seq))

    async def erase(self, seq: int) -> None:
        """Drop every cell of ``seq``."""
        await self._seq_tokens(proto.Erase(self.new_id(), seq))

    async def truncate(self, seq: int, n_keep: int) -> list[int]:
        """Keep the first ``n_keep`` tokens of ``seq``."""
        return await self._seq_tokens(proto.Truncate(self.new_id(), seq, n_keep))

    async def fork(self, seq: int, target: int) -> list[int]:
        """Copy-on-write copy of ``seq`` into ``target``; returns ``target``'s tokens."""
        return await self._seq_tokens(proto.Fork(self.new_id(), seq, target))

    async def context_shift(self, seq: int, n_keep: int, n_discard: int) -> list[int]:
        """llama-server's context shift on ``seq``; returns its tokens."""
        return await self._seq_tokens(proto.ContextShift(self.new_id(), seq, n_keep, n_discard))

    async def save_state(self, seq: int) -> SequenceState:
        """Tokens and llama.cpp sequence state of ``seq``."""
        reply, bufs = await self._request(proto.SaveState(self.new_id(), seq), proto.StateBlob)
        return SequenceState(reply.tokens, reply.state.take(bufs), reply.t_ms)

    async def read_kv(self, seq: int, ranges: Sequence[proto.KVRange]) -> SequenceKV:
        """See :meth:`orchestrator.engine_client.interface.EngineClient.read_kv`."""
        reply, bufs = await self._request(proto.ReadKV(self.new_id(), seq, list(ranges)), proto.KVRecords)
        return SequenceKV(reply.tokens, [t.take(bufs) for t in reply.records], reply.t_ms)

    def release_state(self, state: proto.Buffer) -> None:
        """Give the receive buffer of a :meth:`save_state` reply's state, or of a :meth:`read_kv` record,
        back to the frame reader's pool."""
        RECEIVE_POOL.give(state)

    async def restore_state(self, seq: int, tokens: Sequence[int], state: proto.Buffer) -> float:
        """Replace ``seq`` from tokens + llama.cpp state bytes; returns the worker's time in ms."""
        msg = proto.RestoreState(self.new_id(), seq, list(tokens), proto.Tensor.raw(state))
        reply, _ = await self._request(msg, proto.StateRestored, [state])
        return reply.t_ms

    async def save_file(self, seq: int, path: str) -> proto.FileSaved:
        """See :meth:`orchestrator.engine_client.interface.EngineClient.save_file`."""
        reply, _ = await self._request(proto.SaveFile(self.new_id(), seq, path), proto.FileSaved)
        return reply

    async def load_file(self, seq: int, path: str) -> proto.StateRestored:
        """See :meth:`orchestrator.engine_client.interface.EngineClient.load_file`."""
        reply, _ = await self._request(proto.LoadFile(self.new_id(), seq, path), proto.StateRestored)
        return reply

    async def tokenize(self, text: str, add_special: bool, parse_special: bool) -> proto.TokenizeResult:
        """Tokenize through the worker's vocabulary."""
        reply, _ = await self._request(
            proto.Tokenize(self.new_id(), text, add_special, parse_special), proto.TokenizeResult
        )
        return reply

    async def detokenize(self, ids: Sequence[int]) -> str:
        """Detokenize (ids already validated)."""
        reply, _ = await self._request(proto.Detokenize(self.new_id(), list(ids)), proto.DetokenizeResult)
        return reply.text

    async def classify(self, texts: Sequence[str]) -> Classification:
        """Raw logits of each text from a classifier worker."""
        reply, bufs = await self._request(proto.Classify(self.new_id(), list(texts)), proto.Classified)
        logits = reply.logits
        if logits.dtype != "float32" or len(logits.shape) != 2 or logits.shape[0] != len(texts):
            raise EngineRequestError(ErrorCode.INTERNAL, f"classifier logits {logits} for {len(texts)} texts")
        return Classification(reply.n_tokens, logits.shape[1], bytes(logits.take(bufs)))

    async def check_sampling(self, params: SamplingParams) -> None:
        """See :meth:`orchestrator.engine_client.interface.EngineClient.check_sampling`."""
        await self._request(proto.CheckSampling(self.new_id(), params), proto.SamplingChecked)

    async def engine_state(self) -> proto.EngineState:
        """Which sequences are generating."""
        reply, _ = await self._request(proto.Status(self.new_id()), proto.EngineState)
        return reply
