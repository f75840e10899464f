"""Shared pieces of the client-compatible APIs (OpenAI, llama-server, KoboldCpp).

* :data:`COMPAT_ERRORS`: errors in the shape OpenAI and llama-server clients read
  (:func:`orchestrator.web.errors.compat_error_body`);
* :func:`collect`: run a non-streaming generation, cancelled when the client leaves;
* :func:`started_run`: start a streamed generation (a client that leaves while it waits
  for its slot ends it with ``CLIENT_GONE``);
* :func:`sse_data`: one ``data: {json}`` Server-Sent Event (OpenAI/llama-server framing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from litestar import Request

from contract.errors import ErrorCode
from orchestrator.generation.events import DoneOut, Started, TokenOut
from orchestrator.generation.request import INT32_MAX, CanonicalRequest
from orchestrator.generation.service import RunControl
from orchestrator.services import Services
from orchestrator.web.errors import ApiError, compat_error_body, exception_handlers
from orchestrator.web.slot_header import watch_slot

COMPAT_ERRORS = exception_handlers(compat_error_body)
"""Litestar exception handlers for the OpenAI and llama-server paths (errors in their shape)."""


@dataclass
class Collected:
    """A finished non-streaming generation: every token and the end."""

    tokens: list[TokenOut] = field(default_factory=list)
    done: DoneOut | None = None

    @property
    def end(self) -> DoneOut:
        """The :class:`DoneOut` (always set once :func:`collect` returns)."""
        assert self.done is not None
        return self.done


async def collect(
    services: Services, req: CanonicalRequest, request: Request[Any, Any, Any], control: RunControl | None = None
) -> Collected:
    """Run ``req`` to the end; the generation is cancelled if the client disconnects first."""
    out = Collected()
    async with cancelled_on_disconnect(request, control) as run_control:
        async for ev in services.generation.run(req, run_control):
            if isinstance(ev, TokenOut):
                out.tokens.append(ev)
            elif isinstance(ev, DoneOut):
                out.done = ev
    return out


async def started_run(
    services: Services, req: CanonicalRequest, request: Request[Any, Any, Any], control: RunControl | None = None
) -> AsyncGenerator[Any, None]:
    """The events of ``req`` after :class:`orchestrator.generation.service.Started`: validated, slot held,
    generation begun, so errors up to here are plain 4xx answers.  A client that leaves while
    the request waits (for a busy slot or an engine sequence) ends it with ``CLIENT_GONE``;
    afterwards the streaming response notices a departure and closes the iterator."""
    async with cancelled_on_disconnect(request, control) as run_control:
        run = services.generation.run(req, run_control)
        first = await anext(run)
    assert isinstance(first, Started)
    return run


def piece_text(piece: bytes) -> str:
    """A token's piece as text (invalid UTF-8 replaced; the raw bytes go in ``bytes`` fields)."""
    return piece.decode("utf-8", "replace")


def one_prompt(prompt: str | list[int | str]) -> str | list[int]:
    """A request's one prompt: text, token ids, or a list holding one text (several: ``INVALID_REQUEST``)."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(t, int) for t in prompt):
        return prompt  # type: ignore[return-value]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise ApiError(ErrorCode.INVALID_REQUEST, "prompt must be a text, a list of token ids, or a list of one text")


async def prompt_ids(services: Services, prompt: str | list[int]) -> list[int]:
    """Token ids of a prompt: text is tokenized as llama-server does (``add_special``, special
    tokens parsed); ids are taken as they are (checked later against the vocabulary)."""
    if isinstance(prompt, str):
        return (await services.engine.tokenize(prompt, True, True)).ids
    return list(prompt)


def remaining(services: Services, n_prompt: int) -> int:
    """The default generation length: the tokens left in the window after a prompt of ``n_prompt``;
    with ``--context-shift`` no limit (``INT32_MAX``: llama-server's ``n_predict`` -1 generates until an
    end-of-generation token or the client leaves, shifting the window when it fills)."""
    info = services.generation.info
    if info.runtime.context_shift:
        return INT32_MAX
    return max(0, info.n_ctx - n_prompt)


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


async def _cancel_on_disconnect(request: Request[Any, Any, Any], control: RunControl) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            await control.cancel()
            return
