"""The orchestrator's handle on an engine worker process.

:class:`EngineClient` spawns ``python -m engine.worker`` (or connects to a standalone
one), speaks :mod:`engine.protocol` over a socket, and demultiplexes replies to the
requests that are waiting for them.  HTTP handlers depend on this class only; they
never see frames or sockets.

If the worker dies, every pending request fails with ``EngineDeadError`` (an error
event for streams) and, when ``restart`` is on, a new worker is started; its
sequences are empty, so slots must come back from the store (``on_restart`` hook).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path

import msgspec
import structlog

from engine import protocol as proto
from orchestrator.worker_options import WorkerOptions

log = structlog.get_logger("slotserve.engine")


class EngineDeadError(RuntimeError):
    """The worker is gone (crashed or not started); ``code`` NO_MODEL."""

    code = "NO_MODEL"


class EngineStartError(EngineDeadError):
    """The worker died or failed before ``Ready``: ``stage`` reached, ``returncode`` (``-N``: signal N)."""

    def __init__(self, message: str, stage: str, returncode: int | None) -> None:
        super().__init__(message)
        self.stage = stage
        self.returncode = returncode

    @property
    def crashed(self) -> bool:
        """True when a signal (a crash in native code: SIGSEGV, SIGABRT, SIGILL, SIGBUS) ended the worker."""
        return self.returncode is not None and self.returncode < 0 and -self.returncode != signal.SIGTERM


class EngineRequestError(RuntimeError):
    """The worker answered a request with an ``Error`` (``code``, ``message``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Event = tuple[msgspec.Struct, list[bytes]]


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit status {code}"


class EngineClient:
    """Async client of one engine worker (see module docstring)."""

    def __init__(self, options: WorkerOptions, restart: bool = True) -> None:
        self.options = options
        self.restart = restart
        self.info: proto.ModelInfo | None = None
        self.pieces: list[bytes] = []
        self.generation = 0  # incremented on every (re)start: sequences of older generations are gone
        self.on_restart: Callable[[], Awaitable[None]] | None = None
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Queue[Event | None]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._closing = False
        self._ready = asyncio.Event()
        self.stage = "not started"  # start-up stage reached (engine.protocol.Starting), "ready" once up
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
        return self._proc.pid if self._proc else None

    async def start(self, timeout: float = 300.0) -> proto.ModelInfo:
        """Start (or connect to) the worker and wait for its ``Ready``.

        ``timeout`` (s) bounds each wait: the connection, and every start-up stage
        (:class:`engine.protocol.Starting`).  When a spawned worker crashes (dies by a
        signal) during start-up with CPU weight repacking left to auto, it is started
        once more with repacking off, and a warning says so.  Raises
        :class:`EngineStartError` (stage reached, exit status) when the worker fails.
        """
        try:
            return await self._start_once(timeout)
        except EngineStartError as exc:
            if not (exc.crashed and self.options.connect is None and self.options.repack is None):
                raise
            log.warning(
                "engine worker crashed during start-up; retrying once without CPU weight repacking",
                stage=exc.stage,
                signal=signal.Signals(-exc.returncode).name if exc.returncode else None,
                gives_up="llama.cpp's extra buffer types (repacked CPU weights: faster prefill on some CPUs)",
            )
            self.options = replace(self.options, repack=False)
            return await self._start_once(timeout)

    async def _start_once(self, timeout: float) -> proto.ModelInfo:
        self.stage = "connecting"
        self.load_fraction = 0.0
        if self.options.connect:
            family, addr = proto.parse_address(self.options.connect)
            if family == socket.AF_UNIX:
                reader, writer = await asyncio.open_unix_connection(addr)  # type: ignore[arg-type]
            else:
                host, port = addr  # type: ignore[misc]
                reader, writer = await asyncio.open_connection(host, port)
        else:
            reader, writer = await self._spawn(timeout)
        try:
            reply = await self._await_ready(reader, timeout)
        except BaseException:
            writer.close()
            await self._teardown()
            raise
        self.stage = "ready"
        self.info = reply.info
        self.pieces = reply.pieces
        self._writer = writer
        self.generation += 1
        self._reader_task = asyncio.create_task(self._read_loop(reader), name="engine-reader")
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
            eval_filter=rt.eval_filter,
            threads=rt.n_threads,
        )
        return reply.info

    async def _await_ready(self, reader: asyncio.StreamReader, timeout: float) -> proto.Ready:
        """Follow the worker's :class:`engine.protocol.Starting` reports until ``Ready``."""
        while True:
            try:
                reply, _ = await asyncio.wait_for(proto.read_reply(reader), timeout)
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, proto.ProtocolError) as exc:
                code = await self._exit_status()
                what = f"died with {_describe_exit(code)}" if code is not None else f"stopped answering ({exc!r})"
                log.error("engine worker failed during start-up", stage=self.stage, exit=_describe_exit(code))
                raise EngineStartError(f"worker {what} during stage {self.stage!r}", self.stage, code) from exc
            if isinstance(reply, proto.Ready):
                return reply
            if isinstance(reply, proto.Starting):
                if reply.stage != self.stage:
                    log.info("engine starting", stage=reply.stage)
                self.stage, self.load_fraction = reply.stage, reply.fraction
                continue
            raise EngineStartError(f"worker sent {type(reply).__name__} before Ready", self.stage, None)

    async def _exit_status(self) -> int | None:
        """The spawned worker's exit status once it has exited (waits up to 5 s), else None."""
        if self._proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self._proc.wait(), 5)
        return None

    async def _spawn(self, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self._tmpdir = tempfile.TemporaryDirectory(prefix="slotserve-")
        path = str(Path(self._tmpdir.name) / "worker.sock")
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )

        def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if not accepted.done():
                accepted.set_result((r, w))
            else:
                w.close()

        server = await asyncio.start_unix_server(on_connect, path=path, limit=1 << 20)
        env = {**os.environ, **self.options.extra_env}
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.stage = "spawning"
        self._proc = await asyncio.create_subprocess_exec(*self.options.argv(f"unix:{path}"), env=env)
        try:
            done, _ = await asyncio.wait(
                [accepted, asyncio.ensure_future(self._proc.wait())],
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if accepted not in done:
                code = self._proc.returncode
                await self._teardown()
                raise EngineStartError(f"worker exited with {_describe_exit(code)} before connecting", "spawning", code)
            return accepted.result()
        finally:
            server.close()

    async def close(self) -> None:
        """Ask the worker to finish (flushing its commits) and stop it."""
        self._closing = True
        if self.alive:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.request(proto.Shutdown(0)), 10)
        await self._teardown()

    async def _teardown(self) -> None:
        self._ready.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 10)
            if self._proc.returncode is None:
                self._proc.kill()
                await self._proc.wait()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg, bufs = await proto.read_reply(reader)
                q = self._waiters.get(msg.req)  # type: ignore[attr-defined]
                if q is not None:
                    q.put_nowait((msg, bufs))
        except (asyncio.IncompleteReadError, ConnectionError, proto.ProtocolError) as exc:
            if not self._closing:
                log.error("engine worker connection lost", error=str(exc), pid=self.pid)
        finally:
            self._ready.clear()
            for q in self._waiters.values():
                q.put_nowait(None)
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

    async def _send(self, msg: msgspec.Struct, buffers: Sequence[proto.Buffer] = ()) -> None:
        if not self.alive or self._writer is None:
            raise EngineDeadError("the engine worker is not running")
        async with self._write_lock:
            self._writer.writelines(proto.encode_frame(msg, buffers))
            await self._writer.drain()

    def new_id(self) -> int:
        """A fresh request id."""
        return next(self._ids)

    async def request(self, msg: msgspec.Struct, buffers: Sequence[proto.Buffer] = ()) -> Event:
        """Send ``msg`` and return its single reply; raise :class:`EngineRequestError` on ``Error``."""
        q: asyncio.Queue[Event | None] = asyncio.Queue()
        req = msg.req  # type: ignore[attr-defined]
        self._waiters[req] = q
        try:
            await self._send(msg, buffers)
            item = await q.get()
        finally:
            self._waiters.pop(req, None)
        if item is None:
            raise EngineDeadError("the engine worker died during the request")
        reply, bufs = item
        if isinstance(reply, proto.Error):
            raise EngineRequestError(reply.code, reply.message)
        return reply, bufs

    async def open_stream(self, msg: proto.Generate) -> AsyncIterator[Event]:
        """Send a ``Generate`` now; return an iterator of its ``Token`` events, then its ``Done``.

        An ``Error`` reply raises :class:`EngineRequestError`; a dead worker raises
        :class:`EngineDeadError`.  Leaving the iteration early (client gone) sends a
        ``Cancel`` and drains the stream until ``Done``.
        """
        q: asyncio.Queue[Event | None] = asyncio.Queue()
        self._waiters[msg.req] = q
        try:
            await self._send(msg)
        except BaseException:
            self._waiters.pop(msg.req, None)
            raise
        return self._events(msg.req, q)

    async def _events(self, req: int, q: asyncio.Queue[Event | None]) -> AsyncIterator[Event]:
        finished = False
        try:
            while True:
                item = await q.get()
                if item is None:
                    finished = True
                    raise EngineDeadError("the engine worker died during generation")
                reply = item[0]
                if isinstance(reply, proto.Error):
                    finished = True
                    raise EngineRequestError(reply.code, reply.message)
                if isinstance(reply, proto.Done):
                    finished = True
                    yield item
                    return
                yield item
        finally:
            if not finished and self.alive:
                await asyncio.shield(self._cancel_and_drain(req, q))
            self._waiters.pop(req, None)

    async def cancel(self, req: int) -> None:
        """Ask the worker to cancel generation ``req`` (no reply; its stream ends with ``Done``)."""
        await self._send(proto.Cancel(self.new_id(), req))

    async def _cancel_and_drain(self, req: int, q: asyncio.Queue[Event | None]) -> None:
        with contextlib.suppress(Exception):
            await self._send(proto.Cancel(self.new_id(), req))
            while True:
                item = await asyncio.wait_for(q.get(), 30)
                if item is None or isinstance(item[0], proto.Done | proto.Error):
                    return

    # ------------------------------------------------------------------ conveniences

    async def tokenize(self, text: str, add_special: bool, parse_special: bool) -> proto.TokenizeResult:
        """Tokenize through the worker's vocabulary."""
        reply, _ = await self.request(proto.Tokenize(self.new_id(), text, add_special, parse_special))
        assert isinstance(reply, proto.TokenizeResult)
        return reply

    async def detokenize(self, ids: list[int]) -> str:
        """Detokenize (ids already validated)."""
        reply, _ = await self.request(proto.Detokenize(self.new_id(), ids))
        assert isinstance(reply, proto.DetokenizeResult)
        return reply.text

    async def seq_op(self, op: str, seq: int, arg0: int = 0, arg1: int = 0) -> Event:
        """Run a :class:`engine.protocol.SeqOp` and return its reply."""
        return await self.request(proto.SeqOp(self.new_id(), op, seq, arg0, arg1))

    async def classify(self, texts: list[str]) -> tuple[proto.Classified, bytes]:
        """Raw logits of each text from a classifier worker: the reply and ``float32[n, n_out]`` bytes."""
        reply, bufs = await self.request(proto.Classify(self.new_id(), texts))
        assert isinstance(reply, proto.Classified)
        return reply, bufs[0]

    async def status(self) -> proto.EngineState:
        """Which sequences are offloaded to host memory and which are generating."""
        reply, _ = await self.request(proto.Status(self.new_id()))
        assert isinstance(reply, proto.EngineState)
        return reply

    async def restore(self, seq: int, tokens: list[int], state: proto.Buffer) -> proto.StateBlob:
        """Restore ``seq`` from tokens + llama.cpp state bytes."""
        reply, _ = await self.request(proto.RestoreState(self.new_id(), seq, tokens), [state])
        assert isinstance(reply, proto.StateBlob)
        return reply
