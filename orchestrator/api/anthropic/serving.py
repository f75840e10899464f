"""Anthropic's Messages API over the chat path: a Messages request's turn (messages, tools, thinking budget, as
llama-server converts them: ``tools/server/server-chat.cpp``), its answer and its stream events (the module
docstring of :mod:`orchestrator.api.anthropic.routes` gives the rules)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request

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
    MessageUsage,
    OutputUsage,
    RedactedThinkingBlock,
    SignatureDelta,
    StopReason,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)
from orchestrator.api.common.chat import chat_prompt_ids, reasoning_of
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.common.run import remaining
from orchestrator.generation.answer_text import AnswerText
from orchestrator.generation.chat_template import message_text
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.parsers.reasoning import ReasoningPlan
from orchestrator.generation.pieces import CallDelta, Piece, ReasoningDelta
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.tool_calls import ToolCall
from orchestrator.generation.tool_plan import ToolPlan
from orchestrator.services import Services
from orchestrator.tenants.conversation import anthropic_user_id, identify
from orchestrator.web.errors import ApiError, compat_error_body, error_responses, report
from orchestrator.web.sse import named_event

ERRORS = error_responses(MessageError)
"""The error statuses of these routes, with :class:`MessageError`."""


DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` when the request has none (llama-server's default for this API)."""


DEFAULT_THINKING_BUDGET = 10000
"""``thinking.budget_tokens`` when ``thinking`` is enabled without one (llama-server's)."""


BILLING_HEADER = "x-anthropic-billing-header:"


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
    """``system`` and ``messages`` as OpenAI chat messages (module docstring).  ``INVALID_REQUEST`` (400) for
    an empty ``messages`` list, with Anthropic's message (``/v1/messages`` and ``count_tokens`` alike)."""
    if not data.messages:
        raise ApiError(ErrorCode.INVALID_REQUEST, "messages: at least one message is required")
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
    """One Messages request on the chat path: its generation request, its tool plan (None without tools),
    the model name the answer reports and its reasoning handling (None: a template without thinking tags)."""

    req: CanonicalRequest
    tools: ToolPlan | None
    model: str
    reasoning: ReasoningPlan | None = None

    def answer_text(self) -> AnswerText:
        """A reader of one answer: stop sequences cut, thoughts split out, tool calls parsed."""
        thoughts = self.reasoning.parser() if self.reasoning else None
        return AnswerText(list(self.req.stop_strings), self.tools.splitter() if self.tools else None, thoughts)


async def turn_of(services: Services, request: Request[Any, Any, Any], data: MessagesRequest) -> Turn:
    """The :class:`Turn` of a Messages request (module docstring): its messages and tools rendered by the
    model's template, the slot by ``slot_id`` / ``X-Slot-Id`` (else the server's choice), ``max_tokens``
    4096 by default and never past the window; streamed requests ask for prefill progress (the
    ``message_start`` event's usage comes from it).  Bad values: ``INVALID_REQUEST``."""
    tools = chat_tools(data.tools)
    ids, plan, prompt = await chat_prompt_ids(services, chat_messages(data), tools, chat_tool_choice(data.tool_choice))
    thinking = reasoning_of(services, prompt, None, thinking_budget(data), None)
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
        cache_salt=data.cache_salt,
    ).canonical()
    identify(req, request, anthropic_user_id(data.metadata))  # Anthropic's conversation key: metadata.user_id
    req.wait = True
    req.token_logprobs = False  # the Messages API has none
    if plan:
        plan.constrain(req)
    if thinking:
        thinking.constrain(req)
    return Turn(req, plan if plan is not None and plan.active else None, services.model_id, thinking)


def thinking_budget(data: MessagesRequest) -> int | None:
    """The thinking budget ``thinking`` asks for (None: the server's), as llama-server reads it."""
    thinking = data.thinking
    if thinking is None or thinking.type != "enabled":
        return None
    return thinking.budget_tokens if thinking.budget_tokens is not None else DEFAULT_THINKING_BUDGET


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


async def _events(answer: Answer, run: Any, text: AnswerText, route: str) -> AsyncIterator[bytes]:
    """The stream of one run (module docstring): ``message_start`` with the first token (its usage from the
    last prefill progress), then content blocks in order as the answer's pieces come (:class:`AnswerText`):
    text in a ``text`` block, each tool call in a ``tool_use`` block whose ``input_json_delta`` pieces are its
    arguments as the model writes them (each block stopped before the next starts), then
    ``message_delta`` and ``message_stop``."""
    n_prompt, n_cached = len(answer.shape.req.input_ids or []), 0
    started = False
    block: tuple[int, int | None] | None = None  # the open block: its index, its call's (None: text, -1: thinking)
    n_blocks = 0

    def start() -> list[bytes]:
        nonlocal started
        if started:
            return []
        started = True
        message = answer.message([], usage_of(n_prompt, n_cached, 0), None)
        return [named_event(MessageStart(message=message))]

    def open_block(call: int | None, head: AnswerBlock) -> list[bytes]:
        nonlocal block, n_blocks
        out = close_block()
        block, n_blocks = (n_blocks, call), n_blocks + 1
        return [*out, named_event(ContentBlockStart(index=block[0], content_block=head))]

    def close_block() -> list[bytes]:
        nonlocal block
        if block is None:
            return []
        (index, kind), block = block, None
        signed = [named_event(ContentBlockDelta(index=index, delta=SignatureDelta(signature="")))] if kind == -1 else []
        return [*signed, named_event(ContentBlockStop(index=index))]

    def frames_of(pieces: list[Piece]) -> list[bytes]:
        out: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                if block is None or block[1] != -1:
                    out += open_block(-1, ThinkingBlock(thinking=""))
                assert block is not None
                out.append(named_event(ContentBlockDelta(index=block[0], delta=ThinkingDelta(thinking=piece.text))))
            elif isinstance(piece, CallDelta):
                if piece.name is not None:  # a call begins: its id and name
                    out += open_block(piece.index, ToolUseBlock(id=piece.id or "", name=piece.name))
                if piece.arguments and block is not None:
                    out.append(
                        named_event(
                            ContentBlockDelta(index=block[0], delta=InputJsonDelta(partial_json=piece.arguments))
                        )
                    )
            elif piece:
                if block is None or block[1] is not None:  # after a call or a thought: a new text block
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


ERRORS = error_responses(MessageError)
"""The error statuses of these routes, with :class:`MessageError`."""


def error_body(err: ApiError) -> dict[str, Any]:
    """The error body of these routes: llama-server's (:func:`orchestrator.web.errors.compat_error_body`)
    with Anthropic's ``"type": "error"`` (:class:`MessageError`)."""
    return {"type": "error", **compat_error_body(err)}
