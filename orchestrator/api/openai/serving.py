"""Shaping OpenAI's chat and text completions (OpenAI's API reference, "Chat", "Completions"; llama-server's
OAI-compatible answers): the generation request of a body, the answer and its stream chunks, usage, logprobs."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from litestar import Request
from msgspec import UNSET, UnsetType

from contract import protocol as proto
from orchestrator.api.common.chat import chat_prompt_ids, reasoning_of
from orchestrator.api.common.completion import Completion, CompletionBody, LlamaCompletion
from orchestrator.api.common.run import (
    collect,
    piece_text,
    started_run,
)
from orchestrator.api.common.timings import TimingsClock
from orchestrator.api.common.wire import Attention, PromptProgress, attention_of
from orchestrator.api.openai.canonical import _top_n, canonical
from orchestrator.api.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    FunctionCall,
    FunctionDelta,
    LegacyLogprobs,
    LogprobEntry,
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
from orchestrator.generation.answer_text import AnswerText
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.parsers.reasoning import ReasoningPlan
from orchestrator.generation.pieces import CallDelta, Piece, ReasoningDelta
from orchestrator.generation.request import (
    CanonicalRequest,
)
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.generation.tool_calls import ToolCall
from orchestrator.generation.tool_plan import ToolPlan
from orchestrator.services import Services
from orchestrator.slots.model import slot_id_out
from orchestrator.web.errors import compat_error_body, report, route_of
from orchestrator.web.sse import EventStream, sse_data

T = TypeVar("T")


FINISH = {"length": "length", "stop_token": "stop", "stop_string": "stop", "cancelled": "stop"}


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
        reasoning: ReasoningPlan | None = None,
    ) -> None:
        self.chat = chat
        self.tools = tools if tools is not None and tools.active else None
        self.reasoning = reasoning
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.req = req
        self.want_logprobs = want_logprobs
        self.pieces = pieces
        self.fingerprint = fingerprint

    def join(self, first: Shape) -> None:
        """Answer under ``first``'s id and creation time: several prompts are choices of one answer."""
        self.id, self.created = first.id, first.created

    def answer_text(self, stops: list[str]) -> AnswerText:
        """A reader of one answer of this request: ``stops`` cut, thoughts split out (``reasoning_format``),
        tool calls parsed (when it has tools)."""
        thoughts = self.reasoning.parser() if self.reasoning else None
        return AnswerText(stops, self.tools.splitter() if self.tools else None, thoughts)

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
        """The chunks of ``pieces`` (:class:`orchestrator.generation.answer_text.AnswerText`'s content,
        reasoning and tool-call pieces) of choice ``index``; the first content or reasoning chunk carries
        ``tokens``' logprobs and attention.
        Returns the chunks and the tokens not yet carried."""
        out: list[ChatCompletionChunk | TextCompletionChunk] = []
        for piece in pieces:
            if isinstance(piece, CallDelta):
                out.append(self.call_chunk(piece, index))
            elif isinstance(piece, ReasoningDelta):
                delta = ChatDelta(reasoning_content=piece.text)
                choice = ChatChunkChoice(
                    index=index, delta=delta, finish_reason=None, logprobs=self._chat_logprobs(tokens),
                    attention=self._attention(tokens),
                )  # fmt: skip
                out.append(self._chat_chunk([choice]))
                tokens = []
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
        answer = self.answer_text([]).whole([text])
        content, calls = answer.content, answer.calls
        message = ChatMessage(role="assistant", content=content)
        if answer.reasoning:
            message.reasoning_content = answer.reasoning
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
    """Run a one-choice request (``n`` > 1: :func:`orchestrator.api.openai.choices.respond_choices`); a JSON
    body (``kind``: :class:`ChatCompletion` or :class:`TextCompletion`), or an SSE stream when ``data.stream``."""
    req = shape.req
    stops = list(req.stop_strings)
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
    the model's template, with ``tools`` handled by :mod:`orchestrator.generation.tool_plan` and thoughts
    by :func:`orchestrator.api.common.chat.reasoning_of` (llama-server's reasoning fields)."""
    ids, plan, prompt = await chat_prompt_ids(
        services, data.messages, data.tools, data.tool_choice, data.parallel_tool_calls, data.chat_template_kwargs
    )
    budget = data.reasoning_budget_tokens if data.reasoning_budget_tokens is not None else data.thinking_budget_tokens
    thinking = reasoning_of(services, prompt, data.reasoning_format, budget, data.reasoning_budget_message)
    req = canonical(data, request, ids, services, _top_n(data.logprobs, data.top_logprobs))
    req.post_sampling_probs = data.post_sampling_probs
    req.token_logprobs = bool(data.logprobs)
    if plan:
        plan.constrain(req)
    if thinking:
        thinking.constrain(req)
    pieces = await services.generation.pieces()
    info = services.generation.info
    return Shape(True, services.model_id, req, bool(data.logprobs), pieces, fingerprint(info), plan, thinking)


class ChoiceStream:
    """One streamed choice's text on its way out: stop strings cut and tool calls parsed as they arrive
    (:class:`orchestrator.generation.answer_text.AnswerText`), tokens held until a chunk carries them."""

    def __init__(self, shape: Shape, index: int = 0) -> None:
        self.shape, self.index = shape, index
        self.answer = shape.answer_text(list(shape.req.stop_strings))
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
