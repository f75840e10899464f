"""HTTP generation: ``POST /api/v1/generate`` and the SSE stream (docs/api.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import msgspec
import structlog
from litestar import Controller, Request, post
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from msgspec import UNSET

from orchestrator.api.common import kobold
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.common.kobold import KOBOLD_FINISH, KoboldResult, KoboldTokenEvent, kobold_done_event
from orchestrator.api.common.run import cancelled_on_disconnect
from orchestrator.api.common.wire import token_text
from orchestrator.api.native.protocol import (
    GeneratedToken,
    GenerateResponse,
    TokenAttention,
    done_event,
    hidden_of,
    payload_bytes,
    progress_event,
    sse_token_event,
    token_attention,
    top_logprobs_of,
)
from orchestrator.generation.events import DoneOut, ProgressOut, Started, TokenOut
from orchestrator.generation.service import RunControl
from orchestrator.generation.stop_text import StopTextFilter, trim_stop
from orchestrator.services import Services
from orchestrator.tenants.conversation import identify
from orchestrator.web.body import json_route
from orchestrator.web.encode import encoded
from orchestrator.web.errors import ErrorEvent, report, route_of
from orchestrator.web.sse import JsonEvent, QueuedComment, event_stream, json_event

log = structlog.get_logger("slotserve.api")


async def _raw_body(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The JSON body as a dict (Kobold's sampler fields this server does not model)."""
    try:
        raw = msgspec.json.decode(await request.body())
    except msgspec.DecodeError:
        return {}
    return raw if isinstance(raw, dict) else {}


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
        req = identify(await kobold.prepare(services, data, await _raw_body(request)), request)
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        tokens: list[GeneratedToken] = []
        attention: list[TokenAttention] = []
        done: DoneOut | None = None
        pieces = await services.generation.pieces()
        jobs = kobold.jobs_of(request)
        async with cancelled_on_disconnect(request) as control:
            with jobs.track(data.genkey, control, req.seed) as job:
                async for ev in services.generation.run(req, control):
                    if isinstance(ev, TokenOut):
                        job.n_generated += 1
                        if not ev.is_stop:
                            job.text.append(ev.text)
                        tokens.append(self._token(ev, req.n_probs, pieces))
                        if ev.attention is not None:
                            attention.append(token_attention(ev, req.attention_format, req.attention_dtype))
                    elif isinstance(ev, DoneOut):
                        done = ev
                        jobs.finished(job, ev)
        assert done is not None
        end = done_event(done, req.request_id)
        kobold_text = trim_stop(done.text, done.stop_string) if data.trim_stop else done.text
        return GenerateResponse(
            **msgspec.structs.asdict(end),
            generated_tokens=tokens,
            generated_text=done.text,
            results=[KoboldResult(text=kobold_text, finish_reason=KOBOLD_FINISH.get(done.finish_reason))],
            attention_data=attention if req.attention else UNSET,
        )

    @staticmethod
    def _token(ev: TokenOut, n_probs: int, pieces: list[bytes]) -> GeneratedToken:
        tt = token_text(ev)
        return GeneratedToken(
            token_id=tt.token_id,
            text=tt.text,
            bytes_=tt.bytes_,
            logprob=ev.logprob,
            top_logprobs=top_logprobs_of(ev, pieces) if n_probs else UNSET,
            hidden_state=hidden_of(ev),
        )

    @post(
        "/api/extra/generate/stream",
        status_code=200,
        summary="SSE stream (Kobold events, or attention events)",
        **json_route(GenerateRequest, event_stream("Kobold token events, or attention events, then done")),
    )
    async def stream(
        self, request: Request[Any, Any, Any], services: Services, data: GenerateRequest
    ) -> ServerSentEvent:
        req = identify(await kobold.prepare(services, data, await _raw_body(request)), request)
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        positions: asyncio.Queue[int] = asyncio.Queue()
        control = RunControl(positions.put)
        jobs = kobold.jobs_of(request)
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
                            jobs.finished(job, ev)
                            if req.attention:
                                yield json_event(done_event(ev, req.request_id))
                                return
                            rest = filt.finish(ev.stop_string)
                            if rest:
                                yield json_event(KoboldTokenEvent(token=rest))
                            yield json_event(kobold_done_event(ev.finish_reason))
                            return
                        if isinstance(ev, ProgressOut):
                            yield json_event(progress_event(ev, req.request_id))
                            continue
                        if not isinstance(ev, TokenOut):
                            continue
                        job.n_generated += 1
                        if not ev.is_stop:
                            job.text.append(ev.text)
                        if req.attention:
                            fmt, dtype = req.attention_format, req.attention_dtype
                            frame = await encoded(
                                partial(sse_token_event, ev, req.request_id, fmt, dtype), payload_bytes(ev)
                            )
                            yield JsonEvent(data=frame)
                        else:
                            text = filt.feed("" if ev.is_stop else ev.text)
                            if text or not data.trim_stop:
                                yield json_event(KoboldTokenEvent(token=text))
                except Exception as exc:  # the worker failed mid-stream: tell the client, then end
                    err = report(exc, route_of(request))
                    yield json_event(ErrorEvent.of(err, req.request_id))
                finally:
                    if not first.done():
                        first.cancel()  # the client left while queued: give up its place
                        with contextlib.suppress(BaseException):
                            await first
                    await run.aclose()

        return ServerSentEvent(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
