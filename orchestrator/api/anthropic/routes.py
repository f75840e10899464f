"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, over the chat path.

As llama-server does (``tools/server/server-chat.cpp`` ``server_chat_convert_anthropic_to_oai``), the
request becomes an OpenAI-shaped chat request (messages, tools, tool choice: :func:`turn_of`, run on
:func:`orchestrator.api.common.chat.chat_prompt_ids`: the model's chat template, tool calls by
:mod:`orchestrator.generation.tool_calls`, the slot by ``slot_id`` / ``X-Slot-Id`` or the server's choice):

* ``system`` (a text or text blocks, joined) is a first system message; an
  ``x-anthropic-billing-header:`` system text has its changing ``cch=`` stamp replaced by ``fffff``
  (llama-server's ``normalize_anthropic_billing_header``: the prompt keeps its cached prefix);
* a message's text blocks are its content, its ``thinking`` blocks its ``reasoning_content``, its
  ``tool_use`` blocks its ``tool_calls`` (``input`` as the arguments' JSON); each ``tool_result``
  block becomes a ``tool`` message after it (text blocks joined); images are refused with
  llama-server's "image input is not supported" (400 here: llama-server answers 500);
* ``tools`` (``input_schema`` the parameters) are function tools; ``tool_choice`` ``auto`` / ``any`` /
  ``none`` are ``auto`` / ``required`` / ``none``, ``{"type": "tool", "name"}`` that named function
  (llama-server makes it ``required``); ``stop_sequences`` are ``stop``; ``temperature``, ``top_p``,
  ``top_k`` pass through; ``max_tokens`` defaults to 4096 (bounded by the window); ``metadata`` and
  ``thinking`` are accepted and unused.

The answer is llama-server's ``to_json_anthropic``: ``content`` a text block (when there is text) then
one ``tool_use`` block per call; ``stop_reason`` ``tool_use`` when the answer calls tools, ``max_tokens``
when the limit ended it, ``stop_sequence`` when a stop sequence did (Anthropic's value: llama-server
says ``end_turn`` and fills ``stop_sequence``), else ``end_turn``; ``usage`` with
``cache_read_input_tokens``; the id is Anthropic's form ``msg_...``.  Streamed (``stream: true``),
the events are llama-server's ``to_json_anthropic_stream`` (no ``ping``, no ``[DONE]``), each
block closed before the next opens (Anthropic's order; llama-server closes them all at the end);
text and tool calls are read as they stream (:class:`orchestrator.generation.tool_calls.AnswerText`,
the OpenAI stream's parser): a ``tool_use`` block starts once its call's name is known and its
``input_json_delta`` pieces are the arguments as the model writes them, as llama-server streams them.
Errors have llama-server's body under Anthropic's ``"type": "error"`` (:class:`MessageError`), the
stream's ``error`` event too.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Controller, Request, post

from contract.errors import ErrorCode
from orchestrator.api.anthropic.protocol import (
    AnswerBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    ImageBlock,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageEnd,
    MessageError,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageTokens,
    MessageUsage,
    OutputUsage,
    RedactedThinkingBlock,
    StopReason,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)
from orchestrator.api.common.chat import chat_prompt_ids
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.common.run import collect, remaining, started_run
from orchestrator.generation.chat_template import message_text
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.generation.tool_calls import AnswerText, CallDelta, Piece, ToolCall, ToolPlan
from orchestrator.services import Services
from orchestrator.slots.model import slot_id_out
from orchestrator.web.errors import ApiError, compat_error_body, error_responses, exception_handlers, report, route_of
from orchestrator.web.sse import EventStream, named_event, streamable

DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` when the request has none (llama-server's default for this API)."""

BILLING_HEADER = "x-anthropic-billing-header:"
ERRORS = error_responses(MessageError)
"""The error statuses of these routes, with :class:`MessageError`."""


def error_body(err: ApiError) -> dict[str, Any]:
    """The error body of these routes: llama-server's (:func:`orchestrator.web.errors.compat_error_body`)
    with Anthropic's ``"type": "error"`` (:class:`MessageError`)."""
    return {"type": "error", **compat_error_body(err)}


def normalize_billing_header(text: str) -> str:
    """``text`` with the 5-character ``cch=`` stamp of an ``x-anthropic-billing-header:`` system prompt
    replaced by ``fffff`` (llama-server's ``normalize_anthropic_billing_header``, llama.cpp PR 21793: the
    stamp changes every request, and would end the cached prefix there); other texts unchanged."""
    if not text.startswith(BILLING_HEADER):
        return text
    at = text.find("cch=", len(BILLING_HEADER))
    if at < 0 or text[at + 9 : at + 10] != ";":
        return text
    return text[: at + 4] + "fffff" + text[at + 9 :]


def _image_part(block: ImageBlock) -> dict[str, Any]:
    """An image block as the OpenAI ``image_url`` part llama-server makes of it."""
    src = block.source
    url = f"data:{src.media_type or 'image/jpeg'};base64,{src.data or ''}" if src.type == "base64" else src.url
    return {"type": "image_url", "image_url": {"url": url or ""}}


def _result_text(content: str | list[TextBlock | ImageBlock] | None) -> str:
    """A ``tool_result``'s content as the ``tool`` message's text (images refused: ``INVALID_REQUEST``)."""
    if not isinstance(content, list):
        return content or ""
    parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else _image_part(b) for b in content]
    return message_text(parts)


def chat_messages(data: MessagesRequest) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as OpenAI chat messages (module docstring)."""
    out: list[dict[str, Any]] = []
    if isinstance(data.system, str):
        out.append({"role": "system", "content": normalize_billing_header(data.system)})
    elif data.system is not None:
        out.append({"role": "system", "content": "".join(normalize_billing_header(b.text) for b in data.system)})
    names: dict[str, str] = {}
    for m in data.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        reasoning = ""
        for b in m.content:
            if isinstance(b, TextBlock):
                parts.append({"type": "text", "text": b.text})
            elif isinstance(b, ImageBlock):
                parts.append(_image_part(b))
            elif isinstance(b, ThinkingBlock):
                reasoning += b.thinking
            elif isinstance(b, ToolUseBlock):
                names[b.id] = b.name
                arguments = json.dumps(b.input, ensure_ascii=False)
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}})
            elif isinstance(b, ToolResultBlock):
                result = {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b.content)}
                if b.tool_use_id in names:
                    result["name"] = names[b.tool_use_id]
                results.append(result)
            else:
                assert isinstance(b, RedactedThinkingBlock)  # not for this model's eyes
        if parts or calls or reasoning:
            msg: dict[str, Any] = {"role": m.role, "content": parts or ""}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = reasoning
            out.append(msg)
        out += results
    return out


def chat_tools(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    """Client tools as OpenAI function tools; Anthropic's server tools (another ``type``): ``INVALID_REQUEST``."""
    if tools is None:
        return None
    out = []
    for t in tools:
        if t.type not in (None, "custom"):
            raise ApiError(ErrorCode.INVALID_REQUEST, f"tool {t.name!r}: type {t.type!r} is not supported")
        fn = {"name": t.name, "description": t.description or "", "parameters": t.input_schema}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in OpenAI's form (module docstring); ``tool`` without ``name``: ``INVALID_REQUEST``."""
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(ErrorCode.INVALID_REQUEST, "tool_choice of type 'tool' needs the tool's name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


@dataclass
class Turn:
    """One Messages request on the chat path: its generation request, its tool plan (None without tools)
    and the model name the answer reports."""

    req: CanonicalRequest
    tools: ToolPlan | None
    model: str


async def turn_of(services: Services, request: Request[Any, Any, Any], data: MessagesRequest) -> Turn:
    """The :class:`Turn` of a Messages request (module docstring): its messages and tools rendered by the
    model's template, the slot by ``slot_id`` / ``X-Slot-Id`` (else the server's choice), ``max_tokens``
    4096 by default and never past the window; streamed requests ask for prefill progress (the
    ``message_start`` event's usage comes from it).  Bad values: ``INVALID_REQUEST``."""
    tools = chat_tools(data.tools)
    ids, plan = await chat_prompt_ids(services, chat_messages(data), tools, chat_tool_choice(data.tool_choice))
    room = remaining(services, len(ids))
    slot = next((str(v) for v in (data.slot_id, request.headers.get("x-slot-id")) if v is not None and str(v)), None)
    req = GenerateRequest(
        input_ids=ids,
        max_new_tokens=data.max_tokens if data.max_tokens is not None else min(room, DEFAULT_MAX_TOKENS),
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=data.top_k,
        stop=data.stop_sequences,
        id_slot=slot,
        return_progress=data.stream,
    ).canonical()
    req.wait = True
    if plan:
        plan.constrain(req)
    return Turn(req, plan if plan is not None and plan.active else None, services.model_id)


def stop_reason(done: DoneOut, calls: list[ToolCall]) -> StopReason:
    """Why the answer ended, in Anthropic's words (module docstring)."""
    if done.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if done.finish_reason == "stop_string" else "end_turn"


def tool_use(call: ToolCall) -> ToolUseBlock:
    """A parsed call as a ``tool_use`` block (arguments that are not a JSON object: ``{}``, as llama-server)."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = {}
    return ToolUseBlock(id=call.id, name=call.name, input=args if isinstance(args, dict) else {})


class Answer:
    """The message of one request, as its parts arrive."""

    def __init__(self, shape: Turn) -> None:
        self.shape = shape
        self.id = "msg_" + secrets.token_hex(12)

    @staticmethod
    def end(done: DoneOut, calls: list[ToolCall]) -> MessageEnd:
        """Why the answer ended: ``stop_reason`` (module docstring) and the ``stop_sequence`` that ended it."""
        sequence = done.stop_string if done.finish_reason == "stop_string" and done.stop_string else None
        return MessageEnd(stop_reason=stop_reason(done, calls), stop_sequence=sequence)

    def message(self, content: list[AnswerBlock], usage: MessageUsage, end: MessageEnd | None) -> Message:
        """The message (``end`` None: as ``message_start`` shows it, not ended)."""
        return Message(
            id=self.id,
            content=content,
            model=self.shape.model,
            stop_reason=end.stop_reason if end else None,
            stop_sequence=end.stop_sequence if end else None,
            usage=usage,
        )


def usage_of(n_prompt: int, n_cached: int, n_generated: int) -> MessageUsage:
    """Anthropic's usage as llama-server counts it (:class:`MessageUsage`)."""
    return MessageUsage(cache_read_input_tokens=n_cached, input_tokens=n_prompt - n_cached, output_tokens=n_generated)


class MessagesController(Controller):
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` (errors: :func:`error_body`)."""

    exception_handlers = exception_handlers(error_body)  # type: ignore[assignment]

    @post(
        "/v1/messages",
        status_code=200,
        summary="Anthropic Messages API: create a message",
        responses=streamable(Message, ERRORS),
    )
    async def create(
        self, request: Request[Any, Any, Any], services: Services, data: MessagesRequest
    ) -> EventStream | Message:
        shape = await turn_of(services, request, data)
        answer = Answer(shape)
        stops = list(shape.req.stop_strings)
        if not data.stream:
            got = await collect(services, shape.req, request)
            whole = StopTextFilter.whole(stops, (t.text for t in got.tokens if not t.is_stop), got.end.stop_string)
            said, calls = shape.tools.parse(whole) if shape.tools else (whole, [])
            content: list[AnswerBlock] = [TextBlock(text=said)] if said else []
            content += [tool_use(c) for c in calls]
            end = got.end
            usage = usage_of(end.n_prompt, end.n_cached, end.n_generated)
            message = answer.message(content, usage, answer.end(end, calls))
            message.slot_id = slot_id_out(end.slot_id)
            return message
        run = await started_run(services, shape.req, request)
        return EventStream(_events(answer, run, AnswerText(stops, shape.tools), route_of(request)))

    @post(
        "/v1/messages/count_tokens",
        status_code=200,
        summary="Anthropic Messages API: count a message's prompt tokens",
        responses=ERRORS,
    )
    async def count_tokens(self, services: Services, data: MessagesRequest) -> MessageTokens:
        ids, _ = await chat_prompt_ids(
            services, chat_messages(data), chat_tools(data.tools), chat_tool_choice(data.tool_choice)
        )
        return MessageTokens(input_tokens=len(ids))


async def _events(answer: Answer, run: Any, text: AnswerText, route: str) -> AsyncIterator[bytes]:
    """The stream of one run (module docstring): ``message_start`` with the first token (its usage from the
    last prefill progress), then content blocks in order as the answer's pieces come (:class:`AnswerText`):
    text in a ``text`` block, each tool call in a ``tool_use`` block whose ``input_json_delta`` pieces are its
    arguments as the model writes them (each block stopped before the next starts), then
    ``message_delta`` and ``message_stop``."""
    n_prompt, n_cached = len(answer.shape.req.input_ids or []), 0
    started = False
    block: tuple[int, int | None] | None = None  # the open block: its index, and its call's (None: text)
    n_blocks = 0

    def start() -> list[bytes]:
        nonlocal started
        if started:
            return []
        started = True
        message = answer.message([], usage_of(n_prompt, n_cached, 0), None)
        return [named_event(MessageStart(message=message))]

    def open_block(call: int | None, head: TextBlock | ToolUseBlock) -> list[bytes]:
        nonlocal block, n_blocks
        out = close_block()
        block, n_blocks = (n_blocks, call), n_blocks + 1
        return [*out, named_event(ContentBlockStart(index=block[0], content_block=head))]

    def close_block() -> list[bytes]:
        nonlocal block
        if block is None:
            return []
        index, block = block[0], None
        return [named_event(ContentBlockStop(index=index))]

    def frames_of(pieces: list[Piece]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, CallDelta):
                if piece.name is not None:  # a call begins: its id and name
                    out += open_block(piece.index, ToolUseBlock(id=piece.id or "", name=piece.name))
                if piece.arguments and block is not None:
                    out.append(
                        named_event(
                            ContentBlockDelta(index=block[0], delta=InputJsonDelta(partial_json=piece.arguments))
                        )
                    )
            elif piece:
                if block is None or block[1] is not None:
                    out += open_block(None, TextBlock(text=""))
                assert block is not None
                out.append(named_event(ContentBlockDelta(index=block[0], delta=TextDelta(text=piece))))
        return out

    try:
        async for ev in run:
            frames: list[bytes] = []
            if isinstance(ev, ProgressOut):
                n_prompt, n_cached = ev.total, ev.cache
            elif isinstance(ev, TokenOut):
                frames = start()
                if not ev.is_stop:
                    frames += frames_of(text.feed(ev.text))
            elif isinstance(ev, DoneOut):
                n_prompt, n_cached = ev.n_prompt, ev.n_cached
                frames = start() + frames_of(text.finish(ev.stop_string)) + close_block()
                usage = OutputUsage(output_tokens=ev.n_generated)
                frames.append(named_event(MessageDelta(delta=answer.end(ev, text.calls), usage=usage)))
                frames.append(named_event(MessageStop()))
            for f in frames:
                yield f
    except Exception as exc:  # the worker failed mid-stream: an error event ends the stream
        yield named_event(msgspec.convert(error_body(report(exc, route)), MessageError))
    finally:
        await run.aclose()
