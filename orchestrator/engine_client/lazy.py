"""A second engine worker started on first use (the ``/v1/embeddings`` worker).

The embeddings worker loads the served model again with a pooled context (llama.cpp's
embeddings, ``engine.classifier.Classifier`` with ``embed``); a server that never serves an
embedding never starts it, so it costs neither start-up time nor memory until then.
"""

from __future__ import annotations

import asyncio

from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.interface import EngineClient
from orchestrator.engine_client.launch import WorkerOptions


class LazyWorker:
    """A :class:`WorkerClient` for ``options``, started by the first :meth:`client` call."""

    def __init__(self, options: WorkerOptions) -> None:
        self.worker = WorkerClient(options)
        self._lock = asyncio.Lock()
        self.started = False

    async def client(self) -> EngineClient:
        """The started worker (the first call starts it and waits for its ``Ready``; a failed
        start raises, and the next call tries again)."""
        async with self._lock:
            if not self.started:
                await self.worker.start()
                self.started = True
        return self.worker

    async def close(self) -> None:
        """Stop the worker if it was started."""
        if self.started:
            await self.worker.close()
            self.started = False
