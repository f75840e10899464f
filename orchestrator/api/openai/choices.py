"""``n`` > 1 OpenAI choices: forks of one prefilled prompt (:mod:`orchestrator.generation.choices`), answered
whole or streamed with their ``index``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

from litestar import Request

from orchestrator.api.common.run import (
    cancelled_on_disconnect,
)
from orchestrator.api.openai.protocol import (
    ChatChoice,
    OpenAIRequest,
    TextChoice,
    Usage,
)
from orchestrator.api.openai.serving import ChoiceStream, Shape, usage_of
from orchestrator.generation.choices import ChoiceEvent, forked_choices
from orchestrator.generation.events import DoneOut, TokenOut
from orchestrator.generation.service import RunControl
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.services import Services
from orchestrator.web.errors import compat_error_body, report, route_of
from orchestrator.web.sse import EventStream, sse_data

T = TypeVar("T")


async def respond_choices(
    services: Services, request: Request[Any, Any, Any], data: OpenAIRequest, shape: Shape, kind: type[T]
) -> EventStream | T:
    """:func:`respond` for ``n`` > 1: ``n`` choices, forks of one prefilled prompt
    (:mod:`orchestrator.generation.choices`), indexed 0..n-1; streamed chunks carry their choice's
    ``index``; ``usage`` counts the prompt once and every choice's tokens."""
    n = data.n or 1
    control = RunControl()
    events = forked_choices(services.generation, shape.req, n, services.settings.worker.engine.n_spare, control)
    async with cancelled_on_disconnect(request, control):
        first = await anext(events)  # prefilled and forked: a bad request is a plain 4xx
    assert isinstance(first, DoneOut)
    prompt = first
    stops = list(shape.req.stop_strings)

    def usage(generated: int) -> Usage:
        return usage_of(prompt.n_prompt, prompt.n_cached, generated)

    if not data.stream:
        tokens: list[list[TokenOut]] = [[] for _ in range(n)]
        ends: list[DoneOut | None] = [None] * n
        async with cancelled_on_disconnect(request, control):
            try:
                async for ev in events:
                    if isinstance(ev, ChoiceEvent) and isinstance(ev.event, TokenOut):
                        if not ev.event.is_stop:
                            tokens[ev.index].append(ev.event)
                    elif isinstance(ev, ChoiceEvent):
                        ends[ev.index] = ev.event  # type: ignore[assignment]
            finally:
                await events.aclose()
        choices: list[ChatChoice | TextChoice] = []
        for i, end in enumerate(ends):
            assert end is not None
            text = StopTextFilter.whole(stops, (t.text for t in tokens[i]), end.stop_string)
            choices.append(shape.choice(i, text, tokens[i], end))
        generated = sum(e.n_generated for e in ends if e is not None)
        return shape.completion(choices, usage(generated), first.slot_id)  # type: ignore[return-value]
    include_usage = bool(data.stream_options and data.stream_options.include_usage)

    async def stream() -> AsyncIterator[bytes]:
        outs = [ChoiceStream(shape, i) for i in range(n)]
        generated = 0
        try:
            if shape.chat:
                for i in range(n):
                    yield sse_data(shape.role_chunk(i))
            async for ev in events:
                if not isinstance(ev, ChoiceEvent):
                    continue
                i, e = ev.index, ev.event
                if isinstance(e, TokenOut):
                    for chunk in outs[i].token(e):
                        yield sse_data(chunk)
                else:
                    generated += e.n_generated
                    chunks, finish = outs[i].done(e)
                    for chunk in chunks:
                        yield sse_data(chunk)
                    yield sse_data(shape.chunk(None if shape.chat else "", [], finish, index=i))
            if include_usage:
                yield sse_data(shape.usage_chunk(usage(generated)))
        except Exception as exc:  # the worker failed mid-stream: an error event, then the end
            yield sse_data(compat_error_body(report(exc, route_of(request))))
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"

    return EventStream(stream())
