"""Shaping OpenAI's Responses API over the chat path: input items to chat messages, the answer's output items,
and the streamed events (OpenAI's API reference, "Responses"; llama-server's ``/v1/responses``)."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from contract.errors import ErrorCode
from orchestrator.api.common.timings import TimingsClock
from orchestrator.api.common.wire import PromptProgress
from orchestrator.api.openai.protocol import ChatCompletionRequest
from orchestrator.api.openai.responses.protocol import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextOptions,
    TokenDetails,
)
from orchestrator.api.openai.serving import Shape
from orchestrator.generation.chat_template import message_text
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.pieces import CallDelta, Piece, ReasoningDelta
from orchestrator.generation.tool_calls import ToolCall
from orchestrator.slots.conversations import Kept, StoredConversations
from orchestrator.web.errors import ApiError, compat_error_body, report
from orchestrator.web.sse import named_event


def _text_of(content: Any) -> str:
    """Text of an input item's ``content``: a string or parts ``input_text``/``output_text``/``text``."""
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise ApiError(ErrorCode.INVALID_REQUEST, f"unsupported content part (text only): {part!r:.200}")
            parts.append(part["text"])
        return "".join(parts)
    return message_text(content)


def input_messages(items: str | list[dict[str, Any]], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``before`` (the conversation so far) and Responses ``input`` as chat messages: a text is one
    user message; messages keep their role
    (``developer`` becomes ``system``); consecutive ``function_call`` items become one assistant
    message with ``tool_calls``; ``function_call_output`` a ``tool`` message (named after its call).  Raises
    ``INVALID_REQUEST`` for other items."""
    if isinstance(items, str):
        return [*before, {"role": "user", "content": items}]
    out: list[dict[str, Any]] = [*before]
    names = {c["id"]: c["function"]["name"] for m in out for c in m.get("tool_calls") or []}
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            cid, name = _call_id(item.get("call_id") or item.get("id")), item.get("name")
            call = {
                "id": cid,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments") or "{}"},
            }
            names[cid] = name
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                out[-1] = {**last, "tool_calls": [*last["tool_calls"], call]}  # a kept message stays as it was
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output)
            call_id = _call_id(item.get("call_id"))
            out.append({"role": "tool", "tool_call_id": call_id, "name": names.get(call_id), "content": text})
        else:
            raise ApiError(ErrorCode.INVALID_REQUEST, f"unsupported input item type {kind!r}")
    if len(out) == len(before):
        raise ApiError(ErrorCode.INVALID_REQUEST, "input must not be empty")
    return out


def _call_id(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(ErrorCode.INVALID_REQUEST, "function_call and function_call_output items need a string call_id")
    return value


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat shape (other tool types: ``INVALID_REQUEST``)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise ApiError(ErrorCode.INVALID_REQUEST, f"unsupported tool type {tool.get('type')!r} (function only)")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _response_format(text: TextOptions | None) -> dict[str, Any] | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema or {}}}
    return {"type": fmt.type}


def _forces_call(data: ResponsesRequest) -> bool:
    """Whether ``tool_choice`` forces a call (``required`` or a named function) with tools given: the answer is
    that call, so ``text.format`` is not applied (OpenAI accepts both, as instructor's RESPONSES_TOOLS sends)."""
    named = isinstance(data.tool_choice, dict) and data.tool_choice.get("type") == "function"
    return bool(data.tools) and (data.tool_choice == "required" or named)


class Answer:
    """The response object of one request (OpenAI's ``response``), built as output arrives."""

    def __init__(self, data: ResponsesRequest, shape: Shape, conversations: StoredConversations, tenant: str) -> None:
        self.data = data
        self.shape = shape
        self.conversations = conversations
        self.tenant = tenant
        self.id = "resp_" + secrets.token_hex(24)
        self.msg_id = "msg_" + secrets.token_hex(24)
        self.rs_id = "rs_" + secrets.token_hex(24)
        self.created = int(time.time())
        self.output: list[OutputItem] = []
        self.usage: ResponseUsage | None = None
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None

    def message(self, text: str, status: str = "completed") -> MessageItem:
        """The ``message`` output item holding ``text`` (no part while in progress)."""
        content = [OutputText(text=text)] if status == "completed" else []
        return MessageItem(id=self.msg_id, status=status, content=content)

    def thought(self, text: str, status: str = "completed") -> ReasoningItem:
        """The ``reasoning`` output item holding ``text`` (llama-server's; no part while in progress)."""
        content = [ReasoningText(text=text)] if status == "completed" else []
        return ReasoningItem(id=self.rs_id, status=status, content=content)

    @staticmethod
    def function_call(call: ToolCall, arguments: str | None = None, status: str = "completed") -> FunctionCallItem:
        """A ``function_call`` output item (``arguments`` as given, default the call's)."""
        return FunctionCallItem(
            id="fc_" + call.id.removeprefix("call_"),
            status=status,
            call_id=call.id,
            name=call.name,
            arguments=call.arguments if arguments is None else arguments,
        )

    def end(self, done: DoneOut) -> None:
        """Record the end: usage and status (``incomplete`` when the token limit stopped it)."""
        self.usage = ResponseUsage(
            input_tokens=done.n_prompt,
            input_tokens_details=TokenDetails(cached_tokens=done.n_cached),
            output_tokens=done.n_generated,
            output_tokens_details=TokenDetails(reasoning_tokens=0),
            total_tokens=done.n_prompt + done.n_generated,
        )
        if done.finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"

    def body(self) -> ResponseObject:
        """The response object as it stands."""
        data = self.data
        return ResponseObject(
            id=self.id,
            object="response",
            created_at=self.created,
            status=self.status,
            error=None,
            incomplete_details=self.incomplete,
            instructions=data.instructions,
            max_output_tokens=data.max_output_tokens,
            model=self.shape.model,
            output=list(self.output),
            parallel_tool_calls=bool(data.parallel_tool_calls),
            previous_response_id=data.previous_response_id,
            temperature=data.temperature,
            top_p=data.top_p,
            tool_choice=data.tool_choice if data.tool_choice is not None else "auto",
            tools=data.tools or [],
            text={"format": {"type": "text"}} if data.text is None else msgspec.to_builtins(data.text),
            truncation="disabled",
            metadata=data.metadata or {},
            store=data.store,
            usage=self.usage,
        )

    async def remember(
        self, messages: list[dict[str, Any]], text: str | None, calls: list[ToolCall], slot: str, thought: str = ""
    ) -> None:
        """Keep the conversation (``messages`` plus this answer, its ``thought`` as ``reasoning_content``)
        for ``previous_response_id``, in the caller's tenant."""
        if not self.data.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        if thought:
            reply["reasoning_content"] = thought
        if calls:
            reply["tool_calls"] = [c.openai() for c in calls]
        await self.conversations.put(self.tenant, self.id, Kept(slot, [*messages, reply]))


def _chat_request(data: ResponsesRequest, messages: list[dict[str, Any]], slot: str | None) -> ChatCompletionRequest:
    if data.background:
        raise ApiError(ErrorCode.INVALID_REQUEST, "background responses are not supported")
    system = [{"role": "system", "content": data.instructions}] if data.instructions else []
    body = {
        "messages": system + messages,
        "tools": _chat_tools(data.tools),
        "tool_choice": data.tool_choice,
        "parallel_tool_calls": data.parallel_tool_calls,
        "max_tokens": data.max_output_tokens,
        "temperature": data.temperature,
        "top_p": data.top_p,
        "seed": data.seed,
        "response_format": None if _forces_call(data) else _response_format(data.text),
        "user": data.user,
        "prompt_cache_key": data.prompt_cache_key,
        "cache_salt": data.cache_salt,
        "slot_id": slot if slot is not None else data.slot_id,
        "stream": data.stream,
        "timings_per_token": data.timings_per_token,
        "return_progress": data.return_progress,
        "reasoning_format": data.reasoning_format,
        "reasoning_budget_tokens": data.reasoning_budget_tokens,
        "thinking_budget_tokens": data.thinking_budget_tokens,
        "reasoning_budget_message": data.reasoning_budget_message,
    }
    try:
        return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}") from exc


async def _events(answer: Answer, run: Any, messages: list[dict[str, Any]], route: str) -> AsyncIterator[bytes]:
    """The Responses streaming events of one run (module docstring), numbered from 0: text deltas as the
    text arrives, and each tool call's item as soon as its name is known, then its arguments in pieces
    (``response.function_call_arguments.delta``) as :class:`orchestrator.generation.answer_text.AnswerText`
    reads them."""
    seq = itertools.count()
    shape = answer.shape
    said = shape.answer_text(list(shape.req.stop_strings))
    text = ""
    thought = ""
    thinking: int | None = None  # the open reasoning item's output_index
    where: dict[str, Any] = {"item_id": answer.msg_id, "content_index": 0}  # output_index: once opened
    call_at: list[int] = []  # each call's output_index
    clock = TimingsClock(answer.data.timings_per_token)

    def open_message() -> list[bytes]:
        if "output_index" in where:
            return []
        where["output_index"] = len(answer.output)
        item = answer.message("", "in_progress")
        answer.output.append(item)
        return [
            named_event(OutputItemAdded(sequence_number=next(seq), output_index=where["output_index"], item=item)),
            named_event(ContentPartAdded(sequence_number=next(seq), **where, part=OutputText(text=""))),
        ]

    def think(piece: ReasoningDelta) -> list[bytes]:
        nonlocal thought, thinking
        got: list[bytes] = []
        if thinking is None:
            thinking = len(answer.output)
            answer.output.append(answer.thought("", "in_progress"))
            added = OutputItemAdded(sequence_number=next(seq), output_index=thinking, item=answer.output[thinking])
            got.append(named_event(added))
        thought += piece.text
        delta = ReasoningTextDelta(
            sequence_number=next(seq), item_id=answer.rs_id, output_index=thinking, content_index=0, delta=piece.text
        )
        return [*got, named_event(delta)]

    def end_thought() -> list[bytes]:
        nonlocal thinking
        if thinking is None:
            return []
        index, thinking = thinking, None
        item = answer.output[index] = answer.thought(thought)
        done = ReasoningTextDone(
            sequence_number=next(seq), item_id=answer.rs_id, output_index=index, content_index=0, text=thought
        )
        return [
            named_event(done),
            named_event(OutputItemDone(sequence_number=next(seq), output_index=index, item=item)),
        ]

    def out(pieces: list[Piece]) -> list[bytes]:
        nonlocal text
        got: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                got += think(piece)
                continue
            if piece:
                got += end_thought()
            if isinstance(piece, CallDelta) and piece.name is not None:
                call_at.append(len(answer.output))
                started = answer.function_call(said.calls[piece.index], "", "in_progress")
                answer.output.append(started)
                got.append(
                    named_event(OutputItemAdded(sequence_number=next(seq), output_index=call_at[-1], item=started))
                )
            elif isinstance(piece, CallDelta):
                item_id, index = answer.output[call_at[piece.index]].id, call_at[piece.index]
                delta = FunctionCallArgumentsDelta(
                    sequence_number=next(seq), item_id=item_id, output_index=index, delta=piece.arguments
                )
                got.append(named_event(delta))
            elif piece:
                got += open_message()
                text += piece
                got.append(
                    named_event(OutputTextDelta(sequence_number=next(seq), **where, delta=piece, timings=clock.now()))
                )
        return got

    try:
        yield named_event(ResponseCreated(sequence_number=next(seq), response=answer.body()))
        yield named_event(ResponseInProgress(sequence_number=next(seq), response=answer.body()))
        async for ev in run:
            if isinstance(ev, ProgressOut):
                clock.progress(ev)
                if answer.data.return_progress:
                    progress = PromptProgress(
                        total=ev.total, cache=ev.cache, processed=ev.processed, time_ms=ev.time_ms
                    )
                    yield named_event(
                        ResponseInProgress(
                            sequence_number=next(seq),
                            response=answer.body(),
                            prompt_progress=progress,
                            timings=clock.now(),
                        )
                    )
            elif isinstance(ev, TokenOut):
                clock.token()
            if isinstance(ev, TokenOut) and not ev.is_stop:
                for b in out(said.feed(ev.text)):
                    yield b
            elif isinstance(ev, DoneOut):
                for b in out(said.finish(ev.stop_string)) + end_thought():
                    yield b
                calls = said.calls
                if "output_index" in where or not calls:
                    for b in open_message():
                        yield b
                    item = answer.message(text)
                    yield named_event(OutputTextDone(sequence_number=next(seq), **where, text=text))
                    yield named_event(ContentPartDone(sequence_number=next(seq), **where, part=item.content[0]))
                    index = where["output_index"]
                    yield named_event(OutputItemDone(sequence_number=next(seq), output_index=index, item=item))
                    answer.output[index] = item
                for call, index in zip(calls, call_at, strict=True):
                    call_item = answer.function_call(call)
                    yield named_event(
                        FunctionCallArgumentsDone(
                            sequence_number=next(seq),
                            item_id=call_item.id,
                            output_index=index,
                            name=call.name,
                            arguments=call.arguments,
                        )
                    )
                    yield named_event(OutputItemDone(sequence_number=next(seq), output_index=index, item=call_item))
                    answer.output[index] = call_item
                answer.end(ev)
                await answer.remember(messages, text or None, calls, ev.slot_id, thought)
                final = clock.final(ev)
                yield named_event(ResponseCompleted(sequence_number=next(seq), response=answer.body(), timings=final))
    except Exception as exc:  # the worker failed mid-stream: an error event ends the stream
        err = compat_error_body(report(exc, route))["error"]
        yield named_event(ResponseError(sequence_number=next(seq), code=str(err["code"]), message=err["message"]))
    finally:
        await run.aclose()
