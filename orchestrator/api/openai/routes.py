"""OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Shapes follow OpenAI's API reference (Chat Completions, Completions, Models) as
llama-server serves them (``tools/server/server-task.cpp``: ``to_json_oaicompat*``): SSE
chunks ``data: {json}`` ending ``data: [DONE]``, ``stream_options.include_usage`` (a last
chunk with empty ``choices`` and ``usage``), ``logprobs``/``top_logprobs``,
``usage.prompt_tokens_details.cached_tokens``.  Like llama-server, ``/models`` and
``/chat/completions`` also answer without the ``/v1`` prefix (``/completions`` without it
is llama-server's native completion, see :mod:`orchestrator.api.llama_server.routes`).

slotserve extensions (docs/api.md "OpenAI-compatible API"):

* the slot (KV cache) a request uses: ``slot_id`` in the body, else the ``X-Slot-Id``
  header, else ``user``; a busy slot is waited for (bounded).  Naming none, the server chooses
  by prompt similarity (:mod:`orchestrator.slots.anonymous`); the ``X-Slot-Id`` response header (and
  ``slot_id`` in a non-streamed answer) says which.
* ``"attention": {"format": "aggregated"|"per_layer", "dtype", "layers"}`` adds each
  generated token's attention (base64, as on the other JSON paths) to the choice, per chunk.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import structlog
from litestar import Controller, Request, get, post
from msgspec import UNSET, UnsetType

from contract import protocol as proto
from contract.errors import ErrorCode
from orchestrator.api.common.chat import chat_prompt_ids
from orchestrator.api.common.completion import Completion, CompletionBody, LlamaCompletion
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.common.run import (
    COMPAT_ERRORS,
    cancelled_on_disconnect,
    collect,
    one_prompt,
    piece_text,
    prompt_ids,
    remaining,
    started_run,
)
from orchestrator.api.common.timings import TimingsClock
from orchestrator.api.common.wire import Attention, PromptProgress, attention_of
from orchestrator.api.openai.protocol import (
    MAX_TOP_LOGPROBS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    CompletionRequest,
    FunctionCall,
    FunctionDelta,
    LegacyLogprobs,
    LogprobEntry,
    ModelCard,
    ModelList,
    ModelMeta,
    OpenAIRequest,
    PromptTokensDetails,
    TextChoice,
    TextCompletion,
    TextCompletionChunk,
    ToolCallDelta,
    ToolCallOut,
    TopLogprobEntry,
    Usage,
)
from orchestrator.generation.choices import ChoiceEvent, forked_choices
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.request import (
    CanonicalRequest,
)
from orchestrator.generation.service import RunControl
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.generation.tool_calls import AnswerText, CallDelta, Piece, ToolCall, ToolPlan
from orchestrator.services import Services
from orchestrator.slots.model import slot_id_out
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError, compat_error_body, report, route_of
from orchestrator.web.sse import EventStream, sse_data, streamable

log = structlog.get_logger("slotserve.openai")
T = TypeVar("T")


FINISH = {"length": "length", "stop_token": "stop", "stop_string": "stop", "cancelled": "stop"}


def _slot(data: OpenAIRequest, request: Request[Any, Any, Any]) -> str | None:
    for v in (data.slot_id, request.headers.get("x-slot-id"), data.user):
        if v is not None and str(v) != "":
            return str(v)
    return None


def canonical(
    data: OpenAIRequest, request: Request[Any, Any, Any], ids: list[int], services: Services, n_probs: int
) -> CanonicalRequest:
    """The generation request for an OpenAI body whose prompt is ``ids`` (bad values: ``INVALID_REQUEST``)."""
    if data.n is not None and data.n < 1:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"n={data.n}: n must be at least 1")
    max_tokens = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
    att = data.attention
    fields = data.sampler_fields()
    if data.response_format is not None and data.json_schema is None:
        fields["json_schema"] = data.response_format.schema_json()
    req = GenerateRequest(
        **fields,
        input_ids=ids,
        max_new_tokens=max_tokens if max_tokens is not None else remaining(services, len(ids)),
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=data.top_k,
        min_p=data.min_p,
        repeat_penalty=data.repeat_penalty,
        seed=data.seed,
        stop=data.stop,
        ignore_eos=data.ignore_eos,
        return_attention=att is not None,
        attention_format=att.format if att else "per_layer",
        attention_dtype=att.dtype if att else "float32",
        attention_layers=att.layers if att else None,
        n_probs=n_probs,
        id_slot=_slot(data, request),
        return_progress=data.stream and (data.n or 1) == 1 and (data.return_progress or data.timings_per_token),
    ).canonical()
    req.wait = True
    return req


def fingerprint(info: proto.ModelInfo) -> str:
    """``system_fingerprint``: the build that served the request, in llama-server's form (its
    ``llama_build_info()``, ``"b<build>-<commit>"``, ``server-task.cpp``); the build here is the
    llama-cpp-python version whose llama.cpp serves, e.g. ``b0.3.36-slotserve``."""
    return f"b{info.llama_cpp_version}-slotserve"


def _logprob_entry(t: TokenOut, pieces: list[bytes], post_sampling: bool) -> LogprobEntry:
    """``t``'s ``logprobs.content[]`` entry (OpenAI's); with ``post_sampling`` llama-server's, with ``prob`` and
    ``top_probs`` after the sampler chain."""
    if post_sampling:
        top = [
            TopLogprobEntry(id=k, token=piece_text(pieces[k]), bytes_=list(pieces[k]), prob=p) for k, p in t.top_probs
        ]
        prob = t.prob if t.prob is not None else 1.0  # llama-server's value when it has none
        return LogprobEntry(id=t.token_id, token=piece_text(t.piece), bytes_=list(t.piece), prob=prob, top_probs=top)
    top = [TopLogprobEntry(token=piece_text(pieces[k]), logprob=lp, bytes_=list(pieces[k])) for k, lp in t.top]
    return LogprobEntry(token=piece_text(t.piece), logprob=t.logprob, bytes_=list(t.piece), top_logprobs=top)


def _legacy_logprobs(tokens: list[TokenOut], pieces: list[bytes]) -> LegacyLogprobs:
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t.text)
    return LegacyLogprobs(
        tokens=[piece_text(t.piece) for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[{piece_text(pieces[tok]): lp for tok, lp in t.top} for t in tokens],
        text_offset=offsets,
    )


def usage_of(n_prompt: int, n_cached: int, n_generated: int) -> Usage:
    """OpenAI's ``usage``: ``cached_tokens`` are the prompt tokens reused from the slot's KV cache."""
    return Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_generated,
        total_tokens=n_prompt + n_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=n_cached),
    )


def _usage(done: DoneOut) -> Usage:
    return usage_of(done.n_prompt, done.n_cached, done.n_generated)


class Shape:
    """Builds the response objects and stream chunks of one request (chat or text completion)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        req: CanonicalRequest,
        want_logprobs: bool,
        pieces: list[bytes],
        fingerprint: str,
        tools: ToolPlan | None = None,
    ) -> None:
        self.chat = chat
        self.tools = tools if tools is not None and tools.active else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.req = req
        self.want_logprobs = want_logprobs
        self.pieces = pieces
        self.fingerprint = fingerprint

    def _attention(self, tokens: list[TokenOut]) -> list[Attention | None] | UnsetType:
        """The ``attention`` extension for ``tokens`` (unset unless asked for)."""
        if not self.req.attention:
            return UNSET
        return [attention_of(t, self.req.attention_format, self.req.attention_dtype) for t in tokens]

    def _chat_logprobs(self, tokens: list[TokenOut]) -> ChatLogprobs | UnsetType:
        if not (self.want_logprobs and tokens):
            return UNSET
        post = self.req.post_sampling_probs
        return ChatLogprobs(content=[_logprob_entry(t, self.pieces, post) for t in tokens])

    def _text_choice(self, index: int, text: str, tokens: list[TokenOut], finish: str | None) -> TextChoice:
        logprobs = _legacy_logprobs(tokens, self.pieces) if self.want_logprobs and tokens else None
        return TextChoice(
            index=index, text=text, finish_reason=finish, logprobs=logprobs, attention=self._attention(tokens)
        )

    def _head(self) -> dict[str, Any]:
        """The fields every response and chunk of this request carries."""
        return {"id": self.id, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}

    def _chat_chunk(self, choices: list[ChatChunkChoice], usage: Usage | UnsetType = UNSET) -> ChatCompletionChunk:
        return ChatCompletionChunk(choices=choices, usage=usage, **self._head())

    def _text_chunk(self, choices: list[TextChoice], usage: Usage | UnsetType = UNSET) -> TextCompletionChunk:
        return TextCompletionChunk(choices=choices, usage=usage, **self._head())

    def role_chunk(self, index: int = 0) -> ChatCompletionChunk:
        """A chat stream's first chunk of choice ``index``: the role, ``content: null`` as llama-server."""
        delta = ChatDelta(role="assistant", content=None)
        return self._chat_chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=None)])

    def chunk(
        self, text: str | None, tokens: list[TokenOut], finish: str | None = None, index: int = 0
    ) -> ChatCompletionChunk | TextCompletionChunk:
        """One streamed chunk of choice ``index``: ``text`` (None: an empty chat delta) and its tokens'
        logprobs and attention, or the end (``finish``)."""
        if self.chat:
            delta = ChatDelta() if text is None else ChatDelta(content=text)
            choice = ChatChunkChoice(
                index=index,
                delta=delta,
                finish_reason=finish,
                logprobs=self._chat_logprobs(tokens),
                attention=self._attention(tokens),
            )
            return self._chat_chunk([choice])
        return self._text_chunk([self._text_choice(index, text or "", tokens, finish)])

    def progress_chunk(self, p: ProgressOut) -> ChatCompletionChunk | TextCompletionChunk:
        """A prefill step's chunk (``return_progress``): llama-server's ``prompt_progress`` on a chunk with
        the role delta (chat) or empty text (``server-task.cpp``, ``to_json_oaicompat*``)."""
        c = self.role_chunk() if self.chat else self._text_chunk([self._text_choice(0, "", [], None)])
        c.prompt_progress = PromptProgress(total=p.total, cache=p.cache, processed=p.processed, time_ms=p.time_ms)
        return c

    def call_chunk(self, delta: CallDelta, index: int = 0) -> ChatCompletionChunk:
        """A streamed chunk of choice ``index`` carrying a piece of a tool call (``delta.tool_calls[0]``
        with the call's ``index``; its first piece with ``id``, ``type`` and ``function.name``)."""
        if delta.name is None:
            call = ToolCallDelta(index=delta.index, function=FunctionDelta(arguments=delta.arguments))
        else:
            head = FunctionDelta(name=delta.name, arguments=delta.arguments)
            call = ToolCallDelta(index=delta.index, id=delta.id or "", type="function", function=head)
        choice = ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[call]), finish_reason=None)
        return self._chat_chunk([choice])

    def piece_chunks(
        self, pieces: list[Piece], tokens: list[TokenOut], index: int = 0
    ) -> tuple[list[ChatCompletionChunk | TextCompletionChunk], list[TokenOut]]:
        """The chunks of ``pieces`` (:class:`orchestrator.generation.tool_calls.ToolStream`'s content
        and tool-call pieces) of choice ``index``; the first content chunk carries ``tokens``' logprobs.
        Returns the chunks and the tokens not yet carried."""
        out: list[ChatCompletionChunk | TextCompletionChunk] = []
        for piece in pieces:
            if isinstance(piece, CallDelta):
                out.append(self.call_chunk(piece, index))
            elif piece:
                out.append(self.chunk(piece, tokens, index=index))
                tokens = []
        return out, tokens

    def finish_of(self, done: DoneOut, calls: list[ToolCall]) -> str:
        """A choice's ``finish_reason``: ``tool_calls`` when it called tools (unless cut by the token
        limit: ``length``, as OpenAI), else from the engine's reason."""
        finish = FINISH.get(done.finish_reason, "stop")
        return "tool_calls" if calls and finish != "length" else finish

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk | TextCompletionChunk:
        """The last chunk before ``[DONE]`` with ``stream_options.include_usage``: no choices, the usage."""
        return self._chat_chunk([], usage) if self.chat else self._text_chunk([], usage)

    def choice(self, index: int, text: str, tokens: list[TokenOut], done: DoneOut) -> ChatChoice | TextChoice:
        """Choice ``index`` of the non-streaming response (a chat answer parsed for tool calls when the
        request has tools)."""
        if not self.chat:
            return self._text_choice(index, text, tokens, FINISH.get(done.finish_reason, "stop"))
        content, calls = self.tools.parse(text) if self.tools else (text, [])
        message = ChatMessage(role="assistant", content=content)
        finish = self.finish_of(done, calls)
        if calls:
            message.tool_calls = [
                ToolCallOut(id=c.id, type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in calls
            ]
        return ChatChoice(
            index=index,
            message=message,
            finish_reason=finish,
            logprobs=self._chat_logprobs(tokens),
            attention=self._attention(tokens),
        )

    def completion(
        self, choices: list[ChatChoice | TextChoice], usage: Usage, slot_id: str
    ) -> ChatCompletion | TextCompletion:
        """The non-streaming response of ``choices`` (``slot_id``: slotserve's extension)."""
        tail: dict[str, Any] = {"usage": usage, "slot_id": slot_id_out(slot_id), **self._head()}
        if self.chat:
            chat = [c for c in choices if isinstance(c, ChatChoice)]
            return ChatCompletion(object="chat.completion", choices=chat, **tail)
        text = [c for c in choices if isinstance(c, TextChoice)]
        return TextCompletion(object="text_completion", choices=text, **tail)

    def final(self, text: str, tokens: list[TokenOut], done: DoneOut) -> ChatCompletion | TextCompletion:
        """The non-streaming response of one choice."""
        return self.completion([self.choice(0, text, tokens, done)], _usage(done), done.slot_id)


class ChoiceStream:
    """One streamed choice's text on its way out: stop strings cut (:class:`StopTextFilter`), tool calls
    parsed as they arrive (:class:`orchestrator.generation.tool_calls.ToolStream`), tokens held until a
    chunk carries them."""

    def __init__(self, shape: Shape, index: int = 0) -> None:
        self.shape, self.index = shape, index
        self.answer = AnswerText(list(shape.req.stop_strings), shape.tools)
        self.pending: list[TokenOut] = []

    def _chunks(self, pieces: list[Piece]) -> list[ChatCompletionChunk | TextCompletionChunk]:
        chunks, self.pending = self.shape.piece_chunks(pieces, self.pending, self.index)
        return chunks

    def token(self, ev: TokenOut) -> list[ChatCompletionChunk | TextCompletionChunk]:
        """The chunks a generated token makes ready (none for an end-of-generation token)."""
        if ev.is_stop:
            return []
        self.pending.append(ev)
        return self._chunks(self.answer.feed(ev.text))

    def done(self, ev: DoneOut) -> tuple[list[ChatCompletionChunk | TextCompletionChunk], str]:
        """The chunks left at the end (held text, the tokens not carried yet) and the ``finish_reason``."""
        chunks = self._chunks(self.answer.finish(ev.stop_string))
        if self.pending:
            chunks.append(self.shape.chunk("", self.pending, index=self.index))
        return chunks, self.shape.finish_of(ev, self.answer.calls)


async def verbose_of(
    services: Services, shape: Shape, text: str, tokens: list[TokenOut], done: DoneOut
) -> LlamaCompletion:
    """llama-server's ``__verbose`` (``verbose: true``): its native ``/completion`` answer of the same
    generation (``to_json_non_oaicompat``, ``server-task.cpp``), the prompt as the template rendered it."""
    c = Completion(
        CompletionBody(prompt="", return_tokens=True), shape.req, services.generation.info, shape.pieces, shape.model
    )
    return c.final(text, tokens, done, await services.engine.detokenize(shape.req.input_ids or []))


async def respond(
    services: Services, request: Request[Any, Any, Any], data: OpenAIRequest, shape: Shape, kind: type[T]
) -> EventStream | T:
    """Run the request; a JSON body (``kind``: :class:`ChatCompletion` or :class:`TextCompletion`),
    or an SSE stream when ``data.stream``."""
    req = shape.req
    stops = list(req.stop_strings)
    if (data.n or 1) > 1:
        return await respond_choices(services, request, data, shape, kind)
    if not data.stream:
        got = await collect(services, req, request)
        kept = [t for t in got.tokens if not t.is_stop]
        text = StopTextFilter.whole(stops, (t.text for t in kept), got.end.stop_string)
        answer = shape.final(text, kept, got.end)
        if data.verbose:
            answer.verbose = await verbose_of(services, shape, text, kept, got.end)
        return answer  # type: ignore[return-value]  # kind: the route's own
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    run = await started_run(services, req, request)
    clock = TimingsClock(data.timings_per_token)

    async def events() -> AsyncIterator[bytes]:
        out = ChoiceStream(shape)
        try:
            if shape.chat:
                yield sse_data(shape.role_chunk())
            async for ev in run:
                if isinstance(ev, ProgressOut):
                    clock.progress(ev)
                    if data.return_progress:
                        yield sse_data(shape.progress_chunk(ev))
                elif isinstance(ev, TokenOut):
                    clock.token()
                    for chunk in out.token(ev):
                        chunk.timings = clock.now()
                        yield sse_data(chunk)
                elif isinstance(ev, DoneOut):
                    chunks, finish = out.done(ev)
                    for chunk in chunks:
                        chunk.timings = clock.now()
                        yield sse_data(chunk)
                    last = shape.chunk(None if shape.chat else "", [], finish)
                    if data.verbose:  # as llama-server's stream: no content (it went in the chunks)
                        last.verbose = await verbose_of(services, shape, "", [], ev)
                    usage = shape.usage_chunk(_usage(ev)) if include_usage else None
                    (usage or last).timings = clock.final(ev)  # the final timings on the last chunk (llama-server)
                    yield sse_data(last)
                    if usage is not None:
                        yield sse_data(usage)
        except Exception as exc:  # the worker failed mid-stream: an error event, then the end
            yield sse_data(compat_error_body(report(exc, route_of(request))))
        finally:
            await run.aclose()
        yield b"data: [DONE]\n\n"

    return EventStream(events())


async def chat_shape(services: Services, request: Request[Any, Any, Any], data: ChatCompletionRequest) -> Shape:
    """The :class:`Shape` (and so the generation request) of a chat body: the messages rendered by
    the model's template, with ``tools`` handled by :mod:`orchestrator.generation.tool_calls`."""
    ids, plan = await chat_prompt_ids(services, data.messages, data.tools, data.tool_choice, data.parallel_tool_calls)
    req = canonical(data, request, ids, services, _top_n(data.logprobs, data.top_logprobs))
    req.post_sampling_probs = data.post_sampling_probs
    if plan:
        plan.constrain(req)
    pieces = await services.generation.pieces()
    return Shape(True, services.model_id, req, bool(data.logprobs), pieces, fingerprint(services.generation.info), plan)


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


def _top_n(logprobs: bool | None, top: int | None) -> int:
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
    if top and not logprobs:
        raise ApiError(ErrorCode.INVALID_REQUEST, "top_logprobs needs logprobs: true")
    return top or 0


class OpenAIController(Controller):
    """The OpenAI-compatible paths (errors in OpenAI's ``{"error": {...}}`` shape)."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @get(["/v1/models", "/models"], summary="OpenAI: the loaded model", responses=COMPAT_ERROR_RESPONSES)
    async def models(self, services: Services) -> ModelList:
        info = services.generation.info
        meta = ModelMeta(
            n_ctx_train=info.n_ctx_train,
            n_ctx=info.n_ctx,
            n_vocab=info.vocab_size,
            n_params=info.n_params,
            size=info.size_bytes,
        )
        card = ModelCard(
            id=services.model_id,
            aliases=sorted(services.settings.alias),
            tags=sorted(services.settings.tags),
            object="model",
            created=int(time.time()),
            owned_by="slotserve",
            meta=meta,
        )
        return ModelList(object="list", data=[card])

    @post(
        ["/v1/chat/completions", "/chat/completions"],
        status_code=200,
        summary="OpenAI chat completion",
        responses=streamable(ChatCompletion),
    )
    async def chat(
        self, request: Request[Any, Any, Any], services: Services, data: ChatCompletionRequest
    ) -> EventStream | ChatCompletion:
        if not data.messages:
            raise ApiError(ErrorCode.INVALID_REQUEST, "messages must not be empty")
        shape = await chat_shape(services, request, data)
        return await respond(services, request, data, shape, ChatCompletion)

    @post(
        "/v1/completions",
        status_code=200,
        summary="OpenAI text completion",
        responses=streamable(TextCompletion),
    )
    async def completions(
        self, request: Request[Any, Any, Any], services: Services, data: CompletionRequest
    ) -> EventStream | TextCompletion:
        info = services.generation.info
        if data.echo or data.suffix:
            raise ApiError(ErrorCode.INVALID_REQUEST, "echo and suffix are not supported")
        prompt = one_prompt(data.prompt)
        if data.logprobs is not None and not 0 <= data.logprobs <= 5:
            raise ApiError(ErrorCode.INVALID_REQUEST, "logprobs must be in 0..5")
        ids = await prompt_ids(services, prompt)
        req = canonical(data, request, ids, services, data.logprobs or 0)
        shape = Shape(
            False,
            services.model_id,
            req,
            data.logprobs is not None,
            await services.generation.pieces(),
            fingerprint(info),
        )
        return await respond(services, request, data, shape, TextCompletion)
