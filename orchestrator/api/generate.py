"""HTTP generation: ``POST /api/v1/generate`` (seed 000) and the SSE stream (seed 001)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import structlog
from litestar import Controller, Request, post
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from engine.protocol import Progress
from orchestrator import wire
from orchestrator.api.body import json_route
from orchestrator.errors import from_exception
from orchestrator.generation import DoneOut, RunControl, Started, TokenOut
from orchestrator.schemas import GenerateRequest
from orchestrator.services import Services

log = structlog.get_logger("slotserve.api")
_json = msgspec.json.Encoder()


class JsonEvent(ServerSentEventMessage):
    """A seed-001 event, framed like KoboldCpp: ``event: message\\ndata: {json}\\n\\n``.

    ``data`` is one line of JSON bytes (msgspec escapes every line break inside strings),
    so the frame is joined directly.  Litestar's own ``encode`` splits ``data`` on line
    breaks with a regex and copies it through a StringIO and a UTF-8 encode, which took
    over half of the orchestrator's time for 760 KB attention events (py-spy, 500-token
    context); the frame it would build is the same.
    """

    def encode(self) -> bytes:
        assert isinstance(self.data, bytes)
        return b"".join((b"event: message\ndata: ", self.data, b"\n\n"))


def _sse(obj: dict[str, Any]) -> JsonEvent:
    return JsonEvent(data=_json.encode(obj))


class QueuedComment(ServerSentEventMessage):
    """``: queued position N``: an SSE comment line (ignored by EventSource clients) sent while
    the request waits for a free engine sequence (1 = next; :mod:`orchestrator.admission`)."""

    def encode(self) -> bytes:
        return f": {self.comment}\n\n".encode()


async def _queued_comments(first: asyncio.Future[Any], positions: asyncio.Queue[int]) -> AsyncIterator[QueuedComment]:
    """One :class:`QueuedComment` per queue position until ``first`` (the run's start) is done;
    then re-raises what the start raised (a queue timeout, a store failure...)."""
    while not first.done():
        getter = asyncio.ensure_future(positions.get())
        await asyncio.wait({first, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            yield QueuedComment(comment=f"queued position {getter.result()}")
        else:
            getter.cancel()
    first.result()


async def _cancel_on_disconnect(request: Request[Any, Any, Any], control: RunControl) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            await control.cancel()
            return


@asynccontextmanager
async def cancelled_on_disconnect(request: Request[Any, Any, Any]) -> AsyncIterator[RunControl]:
    """A :class:`RunControl` that cancels the generation when the client of a non-streaming
    request goes away (also before the generation starts, e.g. while it waits for its slot)."""
    control = RunControl()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, control))
    try:
        yield control
    finally:
        watcher.cancel()


class GenerateController(Controller):
    """Non-streaming and SSE generation."""

    @post(
        "/api/v1/generate",
        status_code=200,
        summary="Generate (non-streaming) with base64 attention",
        **json_route(GenerateRequest),
    )
    async def generate(
        self, request: Request[Any, Any, Any], services: Services, data: GenerateRequest
    ) -> dict[str, Any]:
        req = data.canonical()
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        tokens: list[dict[str, Any]] = []
        attention: list[dict[str, Any]] = []
        done: DoneOut | None = None
        pieces = await services.generation.pieces()
        async with cancelled_on_disconnect(request) as control:
            async for ev in services.generation.run(req, control):
                if isinstance(ev, TokenOut):
                    tok = wire.token_text_fields(ev) | {"logprob": ev.logprob}
                    if req.n_probs:
                        tok["top_logprobs"] = wire.top_logprobs(ev, pieces)
                    hidden = wire.hidden_json(ev)
                    if hidden is not None:
                        tok["hidden_state"] = hidden
                    tokens.append(tok)
                    if ev.attention is not None:
                        entry = wire.token_text_fields(ev)
                        entry["attention"] = wire.attention_json(ev, req.attention_format, req.attention_dtype)
                        attention.append(entry)
                elif isinstance(ev, DoneOut):
                    done = ev
        assert done is not None
        body = wire.done_event(done, req.request_id)
        body.update(
            generated_tokens=tokens,
            generated_text=done.text,
            results=[{"text": done.text, "finish_reason": wire.KOBOLD_FINISH.get(done.done.finish_reason)}],
        )
        if req.attention:
            body["attention_data"] = attention
        return body

    @post(
        "/api/extra/generate/stream",
        status_code=200,
        summary="SSE stream (Kobold events, or attention events)",
        **json_route(GenerateRequest),
    )
    async def stream(
        self, request: Request[Any, Any, Any], services: Services, data: GenerateRequest
    ) -> ServerSentEvent:
        req = data.canonical()
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        positions: asyncio.Queue[int] = asyncio.Queue()
        run = services.generation.run(req, RunControl(positions.put))
        # Validate and take the slot before the response starts, so bad input is a 4xx; a
        # request queued for an engine sequence starts the stream with its position instead.
        first = asyncio.ensure_future(anext(run))
        getter = asyncio.ensure_future(positions.get())
        await asyncio.wait({first, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            positions.put_nowait(getter.result())
        getter.cancel()
        if first.done():
            assert isinstance(first.result(), Started)

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            try:
                async for comment in _queued_comments(first, positions):
                    yield comment
                async for ev in run:
                    if isinstance(ev, DoneOut):
                        done = wire.done_event(ev, req.request_id) if req.attention else wire.kobold_done_event(ev)
                        yield _sse(done)
                        return
                    if isinstance(ev, Progress):
                        yield _sse(wire.progress_event(ev, req.request_id))
                        continue
                    if not isinstance(ev, TokenOut):
                        continue
                    if req.attention:
                        yield _sse(
                            wire.sse_attention_event(ev, req.request_id, req.attention_format, req.attention_dtype)
                        )
                    else:
                        yield _sse(wire.kobold_token_event(ev))
            except Exception as exc:  # the worker failed mid-stream: tell the client, then end
                err = from_exception(exc)
                yield _sse({"type": "error", "request_id": req.request_id, **err.body()})
            finally:
                if not first.done():
                    first.cancel()  # the client left while queued: give up its place
                    with contextlib.suppress(BaseException):
                        await first
                await run.aclose()

        return ServerSentEvent(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
