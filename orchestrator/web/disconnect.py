"""A request's generation cancelled when its HTTP client goes away.

Every generating route (native, OpenAI, llama-server, Anthropic, Ollama...) wraps its run in
:func:`cancelled_on_disconnect`: it watches the ASGI ``receive`` channel for ``http.disconnect``
and cancels the run's :class:`orchestrator.generation.service.RunControl`, and it reports the slot
the run uses in ``X-Slot-Id`` (:mod:`orchestrator.web.slot_header`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Request

from orchestrator.generation.service import RunControl
from orchestrator.web.slot_header import watch_slot


async def _cancel_on_disconnect(request: Request[Any, Any, Any], control: RunControl) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            await control.cancel()
            return


@asynccontextmanager
async def cancelled_on_disconnect(
    request: Request[Any, Any, Any], control: RunControl | None = None
) -> AsyncIterator[RunControl]:
    """``control`` (or a new :class:`RunControl`), cancelled when the client of a request goes
    away: the generation stops, and a request still waiting (for a busy slot, or for an engine
    sequence in the admission queue: ``control.hooks``) ends with ``CLIENT_GONE``, untouched.

    Start it only once the request's body has been read (it reads the ASGI ``receive`` channel
    for ``http.disconnect``).  Nested blocks with the same ``control`` share one watcher."""
    control = control or RunControl()
    watch_slot(request.scope, control)  # X-Slot-Id on the answer
    if control.watched:
        yield control
        return
    control.watched = True
    watcher = asyncio.create_task(_cancel_on_disconnect(request, control))
    try:
        yield control
    finally:
        watcher.cancel()
        control.watched = False
