"""A second engine worker started on first use and stopped when idle (the ``/v1/embeddings`` worker).

The embeddings worker loads the served model again with a pooled context (llama.cpp's
embeddings, ``engine.classifier.Classifier`` with ``embed``); a server that never serves an
embedding never starts it, so it costs neither start-up time nor memory until then, and once no
request has used it for ``keep_alive_s`` seconds it is stopped again (Ollama's ``keep_alive`` for a
model, five minutes by default), giving its memory back; the next request starts it anew.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.interface import EngineClient
from orchestrator.engine_client.launch import WorkerOptions


class LazyWorker:
    """A :class:`WorkerClient` for ``options``, started by the first :meth:`use` and stopped ``keep_alive_s``
    seconds after its last use ended (0 or less: kept until :meth:`close`)."""

    def __init__(self, options: WorkerOptions, keep_alive_s: float = 300.0) -> None:
        self.options = options
        self.keep_alive_s = keep_alive_s
        self.worker: WorkerClient | None = None
        self.starts = 0  # how many times a worker was started (a figure for /metrics and the tests)
        self._lock = asyncio.Lock()
        self._users = 0
        self._idle: asyncio.TimerHandle | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        """Whether a worker runs now."""
        return self.worker is not None

    @asynccontextmanager
    async def use(self) -> AsyncIterator[EngineClient]:
        """The started worker for the block's duration (the first use starts it and waits for its
        ``Ready``; a failed start raises, and the next use tries again); it is not stopped while in use."""
        async with self._lock:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            if self.worker is None:
                worker = WorkerClient(self.options)
                await worker.start()
                self.worker, self.starts = worker, self.starts + 1
            self._users += 1
            worker = self.worker
        try:
            yield worker
        finally:
            self._users -= 1
            if self._users == 0 and self.keep_alive_s > 0:
                self._idle = asyncio.get_running_loop().call_later(self.keep_alive_s, self._stop_when_idle)

    def _stop_when_idle(self) -> None:
        self._idle = None
        self._stopping = asyncio.ensure_future(self._stop(only_if_idle=True))

    async def _stop(self, only_if_idle: bool) -> None:
        async with self._lock:
            if self.worker is None or (only_if_idle and self._users):
                return
            worker, self.worker = self.worker, None
            await worker.close()

    async def close(self) -> None:
        """Stop the worker if it runs (and any pending idle stop)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        await self._stop(only_if_idle=False)
