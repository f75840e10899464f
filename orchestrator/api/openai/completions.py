"""OpenAI's legacy ``POST /v1/completions``, one prompt or several.

``prompt`` is OpenAI's (API reference, "Create completion": a string, an array of strings, an array of
tokens, or an array of token arrays), read as llama-server reads it (``tokenize_input_prompts``,
:func:`orchestrator.api.common.prompts.split_prompts`): a list holding no number is several
prompts.  Several prompts are answered as OpenAI and llama-server answer them: one choice per prompt,
``index`` the prompt's place, one ``usage`` over all of them (prompt and generated tokens summed).
Each prompt is its own generation on its own slot (a request naming no slot gets one per prompt by
prompt similarity; a named slot serves the prompts one after the other), run one after the other when
not streamed (as llama-server's ``/completion`` here); streamed, all started at once, their chunks
interleaved as they are generated, each with its prompt's ``index`` and each prompt's last chunk with
its ``finish_reason``.  Every prompt is tokenized and checked (token ids in the
vocabulary) before any runs, so a bad prompt is a 4xx that changes no slot.  ``n`` > 1 is taken with one
prompt only (forks of one prefilled prompt, :func:`orchestrator.api.openai.choices.respond_choices`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Request, post

from contract.errors import ErrorCode
from orchestrator.api.common.prompts import split_prompts, subprompt_ids
from orchestrator.api.common.run import COMPAT_ERRORS, collect, started_run
from orchestrator.api.openai.canonical import canonical
from orchestrator.api.openai.choices import respond_choices
from orchestrator.api.openai.protocol import CompletionRequest, TextChoice, TextCompletion, Usage
from orchestrator.api.openai.serving import ChoiceStream, Shape, fingerprint, respond, usage_of
from orchestrator.generation.events import DoneOut, TokenOut
from orchestrator.generation.interleave import interleaved
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.service import RunControl
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.services import Services
from orchestrator.tokens import check_tokens
from orchestrator.web.errors import ApiError, compat_error_body, report, route_of
from orchestrator.web.sse import EventStream, sse_data, streamable


async def text_shapes(services: Services, request: Request[Any, Any, Any], data: CompletionRequest) -> list[Shape]:
    """One :class:`Shape` per prompt of ``data`` (module docstring), sharing the first one's ``id``.
    Raises ``INVALID_REQUEST`` (echo, suffix, ``logprobs`` outside 0..5, an empty prompt list, ``n`` > 1
    with several prompts) and ``INVALID_TOKEN`` before any generation starts."""
    if data.echo or data.suffix:
        raise ApiError(ErrorCode.INVALID_REQUEST, "echo and suffix are not supported")
    if data.logprobs is not None and not 0 <= data.logprobs <= 5:
        raise ApiError(ErrorCode.INVALID_REQUEST, "logprobs must be in 0..5")
    prompts = split_prompts(data.prompt)
    if len(prompts) > 1 and (data.n or 1) > 1:
        raise ApiError(ErrorCode.INVALID_REQUEST, "n > 1 is supported with one prompt only")
    info = services.generation.info
    pieces = await services.generation.pieces()
    shapes: list[Shape] = []
    for k, prompt in enumerate(prompts):
        ids = await subprompt_ids(services, prompt)
        if len(prompts) > 1:
            check_tokens(ids, info.vocab_size, f"prompt {k}")
        req = canonical(data, request, ids, services, data.logprobs or 0)
        req.token_logprobs = data.logprobs is not None  # logprobs 0: the token's own, no alternatives
        shape = Shape(False, services.model_id, req, req.token_logprobs, pieces, fingerprint(info))
        if shapes:
            shape.join(shapes[0])
        shapes.append(shape)
    return shapes


def _usage(dones: list[DoneOut]) -> Usage:
    return usage_of(sum(d.n_prompt for d in dones), sum(d.n_cached for d in dones), sum(d.n_generated for d in dones))


async def _whole(services: Services, request: Request[Any, Any, Any], shapes: list[Shape]) -> TextCompletion:
    """The non-streaming answer of several prompts, a choice each: the generations run one after the other,
    as the non-streamed ``/completion`` runs its prompts (one watcher of the client's connection at a time)."""
    results = [await collect(services, s.req, request) for s in shapes]
    choices: list[TextChoice] = []
    for k, (shape, got) in enumerate(zip(shapes, results, strict=True)):
        kept = [t for t in got.tokens if not t.is_stop]
        text = StopTextFilter.whole(list(shape.req.stop_strings), (t.text for t in kept), got.end.stop_string)
        choice = shape.choice(k, text, kept, got.end)
        assert isinstance(choice, TextChoice)
        choices.append(choice)
    answer = shapes[0].completion(list(choices), _usage([g.end for g in results]), results[0].end.slot_id)
    assert isinstance(answer, TextCompletion)
    return answer


async def _streamed(
    services: Services, request: Request[Any, Any, Any], data: CompletionRequest, shapes: list[Shape]
) -> EventStream:
    """The SSE answer of several prompts: the first started before the response (a bad request is a plain
    4xx), the others once the stream runs (one may wait for a slot another holds); chunks interleaved."""
    first = await started_run(services, shapes[0].req, request)

    async def later(req: CanonicalRequest) -> AsyncIterator[Any]:
        control = RunControl()
        control.watched = True  # the stream's end (a client leaving) cancels it
        run = await started_run(services, req, request, control)
        try:
            async for ev in run:
                yield ev
        finally:
            await run.aclose()

    sources = [first, *(later(s.req) for s in shapes[1:])]
    include_usage = bool(data.stream_options and data.stream_options.include_usage)

    async def events() -> AsyncIterator[bytes]:
        outs = [ChoiceStream(s, k) for k, s in enumerate(shapes)]
        dones: list[DoneOut] = []
        try:
            async with contextlib.aclosing(interleaved(sources)) as merged:
                async for k, ev in merged:
                    if isinstance(ev, TokenOut):
                        for chunk in outs[k].token(ev):
                            yield sse_data(chunk)
                    elif isinstance(ev, DoneOut):
                        dones.append(ev)
                        chunks, finish = outs[k].done(ev)
                        for chunk in chunks:
                            yield sse_data(chunk)
                        yield sse_data(shapes[k].chunk("", [], finish, index=k))
            if include_usage:
                yield sse_data(shapes[0].usage_chunk(_usage(dones)))
        except Exception as exc:  # the worker failed mid-stream: an error event, then the end
            yield sse_data(compat_error_body(report(exc, route_of(request))))
        yield b"data: [DONE]\n\n"

    return EventStream(events())


class CompletionsController(Controller):
    """``POST /v1/completions`` (errors in OpenAI's ``{"error": {...}}`` shape)."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @post("/v1/completions", status_code=200, summary="OpenAI text completion", responses=streamable(TextCompletion))
    async def completions(
        self, request: Request[Any, Any, Any], services: Services, data: CompletionRequest
    ) -> EventStream | TextCompletion:
        shapes = await text_shapes(services, request, data)
        if len(shapes) == 1 and (data.n or 1) > 1:
            return await respond_choices(services, request, data, shapes[0], TextCompletion)
        if len(shapes) == 1:
            return await respond(services, request, data, shapes[0], TextCompletion)
        if data.stream:
            return await _streamed(services, request, data, shapes)
        return await _whole(services, request, shapes)
