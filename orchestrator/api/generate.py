"""HTTP generation: ``POST /api/v1/generate`` and the SSE stream (docs/api.md)."""

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
from orchestrator.api import kobold
from orchestrator.api.body import json_route
from orchestrator.errors import report, route_of
from orchestrator.generation import DoneOut, RunControl, Started, TokenOut
from orchestrator.responses import GenerateResponse, event_stream
from orchestrator.schemas import GenerateRequest
from orchestrator.services import Services
from orchestrator.stop_text import StopTextFilter, trim_stop

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


async def _raw_body(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The JSON body as a dict (Kobold's sampler fields this server does not model)."""
    try:
        raw = msgspec.json.decode(await request.body())
    except msgspec.DecodeError:
        return {}
    return raw if isinstance(raw, dict) else {}


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
async def cancelled_on_disconnect(
    request: Request[Any, Any, Any], control: RunControl | None = None
) -> AsyncIterator[RunControl]:
    """``control`` (or a new :class:`RunControl`), cancelled when the client of a request goes
    away: the generation stops, and a request still waiting (for a busy slot, or for an engine
    sequence in the admission queue: ``control.hooks``) ends with ``CLIENT_GONE``, untouched.

    Start it only once the request's body has been read (it reads the ASGI ``receive`` channel
    for ``http.disconnect``).  Nested blocks with the same ``control`` share one watcher."""
    control = control or RunControl()
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
    ) -> GenerateResponse:
        req = await kobold.prepare(services, data, await _raw_body(request))
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        tokens: list[dict[str, Any]] = []
        attention: list[dict[str, Any]] = []
        done: DoneOut | None = None
        pieces = await services.generation.pieces()
        jobs = kobold.jobs_of(request.app.state)
        async with cancelled_on_disconnect(request) as control:
            with jobs.track(data.genkey, control, req.seed) as job:
                async for ev in services.generation.run(req, control):
                    if isinstance(ev, TokenOut):
                        job.n_tokens += 1
                        if not ev.is_stop:
                            job.text.append(ev.text)
                        tokens.append(self._token(ev, req.n_probs, pieces))
                        if ev.attention is not None:
                            entry = wire.token_text_fields(ev)
                            entry["attention"] = wire.attention_json(ev, req.attention_format, req.attention_dtype)
                            attention.append(entry)
                    elif isinstance(ev, DoneOut):
                        done = ev
                        jobs.finished(job, ev.done)
        assert done is not None
        body = wire.done_event(done, req.request_id)
        kobold_text = trim_stop(done.text, done.done.stop_string) if data.trim_stop else done.text
        body.update(
            generated_tokens=tokens,
            generated_text=done.text,
            results=[{"text": kobold_text, "finish_reason": wire.KOBOLD_FINISH.get(done.done.finish_reason)}],
        )
        if req.attention:
            body["attention_data"] = attention
        return msgspec.convert(body, GenerateResponse)

    @staticmethod
    def _token(ev: TokenOut, n_probs: int, pieces: list[bytes]) -> dict[str, Any]:
        tok = wire.token_text_fields(ev) | {"logprob": ev.logprob}
        if n_probs:
            tok["top_logprobs"] = wire.top_logprobs(ev, pieces)
        hidden = wire.hidden_json(ev)
        if hidden is not None:
            tok["hidden_state"] = hidden
        return tok

    @post(
        "/api/extra/generate/stream",
        status_code=200,
        summary="SSE stream (Kobold events, or attention events)",
        **json_route(GenerateRequest, event_stream("Kobold token events, or attention events, then done")),
    )
    async def stream(
        self, request: Request[Any, Any, Any], services: Services, data: GenerateRequest
    ) -> ServerSentEvent:
        req = await kobold.prepare(services, data, await _raw_body(request))
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        positions: asyncio.Queue[int] = asyncio.Queue()
        control = RunControl(positions.put)
        jobs = kobold.jobs_of(request.app.state)
        run = services.generation.run(req, control)
        # Validate and take the slot before the response starts, so bad input is a 4xx; a
        # request queued for an engine sequence starts the stream with its position instead.
        first = asyncio.ensure_future(anext(run))
        getter = asyncio.ensure_future(positions.get())
        async with cancelled_on_disconnect(request, control):  # e.g. while it waits for a busy slot
            await asyncio.wait({first, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            positions.put_nowait(getter.result())
        getter.cancel()
        if first.done():
            assert isinstance(first.result(), Started)
        # trim_stop: text that may become a stop string is held back, the stop string never sent
        filt = StopTextFilter(req.stop_strings if data.trim_stop else [])

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            with jobs.track(data.genkey, control, req.seed) as job:
                try:
                    async for comment in _queued_comments(first, positions):
                        yield comment
                    async for ev in run:
                        if isinstance(ev, DoneOut):
                            jobs.finished(job, ev.done)
                            if req.attention:
                                yield _sse(wire.done_event(ev, req.request_id))
                                return
                            rest = filt.finish(ev.done.stop_string)
                            if rest:
                                yield _sse(wire.kobold_token_event(rest))
                            yield _sse(wire.kobold_done_event(ev))
                            return
                        if isinstance(ev, Progress):
                            yield _sse(wire.progress_event(ev, req.request_id))
                            continue
                        if not isinstance(ev, TokenOut):
                            continue
                        job.n_tokens += 1
                        if not ev.is_stop:
                            job.text.append(ev.text)
                        if req.attention:
                            yield _sse(
                                wire.sse_attention_event(ev, req.request_id, req.attention_format, req.attention_dtype)
                            )
                        else:
                            text = filt.feed("" if ev.is_stop else ev.text)
                            if text or not data.trim_stop:
                                yield _sse(wire.kobold_token_event(text))
                except Exception as exc:  # the worker failed mid-stream: tell the client, then end
                    err = report(exc, route_of(request))
                    yield _sse({"type": "error", "request_id": req.request_id, **err.body()})
                finally:
                    if not first.done():
                        first.cancel()  # the client left while queued: give up its place
                        with contextlib.suppress(BaseException):
                            await first
                    await run.aclose()

        return ServerSentEvent(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
