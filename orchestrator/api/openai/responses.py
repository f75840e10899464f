"""OpenAI's Responses API: ``POST /v1/responses`` (and ``/responses``), over the chat path.

Shapes follow OpenAI's API reference ("Responses": create a response, the response object,
streaming events) as the ``openai`` SDK reads them (``client.responses.create`` and
``client.responses.stream``): ``input`` is a text or a list of items (messages with text or
``input_text``/``output_text`` parts, ``function_call`` and ``function_call_output`` items),
``instructions`` a system message put first, ``tools`` flat function tools
(``{"type": "function", "name", "description", "parameters"}``), ``text.format`` the output's
format (``text``, ``json_object``, ``json_schema``), ``max_output_tokens``.  The request becomes
a chat request (:func:`orchestrator.api.openai.chat_shape`: the model's template, tool calls by
:mod:`orchestrator.generation.tool_calls`); the answer is a ``message`` output item with one
``output_text`` part, and one ``function_call`` item per tool call.

Streaming sends ``event: <type>`` / ``data: {json}`` Server-Sent Events, each with a
``sequence_number``: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, (``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``) or (``response.function_call_arguments.delta``... as the
arguments arrive, ``response.function_call_arguments.done``), ``response.output_item.done``, and last
``response.completed`` (also when ``max_output_tokens`` ended the answer: its response then has
``status: "incomplete"``, as the SDK's ``responses.stream`` needs ``response.completed`` and as
llama-server sends it), or ``error`` if the engine failed mid-way.  No ``[DONE]`` line: the
Responses API has none.

``previous_response_id`` continues a conversation: this server keeps, per process, the last
:data:`MAX_KEPT` responses' conversations (their messages, without ``instructions``, as OpenAI
does not carry them over) and the slot each ran on, so the continuation runs on the same slot
and reuses its KV cache for the shared prefix.  The map is in memory: it is lost on restart
and not shared between nodes, and the oldest entries are dropped first; an unknown id is
``NOT_FOUND``.  ``store: false`` keeps nothing.  Not supported: ``background``, ``conversation``,
``item_reference`` items, non-text content (400), retrieving or deleting stored responses.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, post

from contract.errors import ErrorCode
from orchestrator.api.common.run import COMPAT_ERRORS, collect, started_run
from orchestrator.api.common.timings import TimingsClock
from orchestrator.api.common.wire import PromptProgress
from orchestrator.api.openai.protocol import (
    ChatCompletionRequest,
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
from orchestrator.api.openai.routes import Shape, chat_shape
from orchestrator.generation.chat_template import message_text
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.tool_calls import AnswerText, CallDelta, Piece, ToolCall
from orchestrator.services import Services
from orchestrator.web.errors import ApiError, compat_error_body, report, route_of
from orchestrator.web.sse import EventStream, named_event, streamable

MAX_KEPT = 1024
"""Conversations kept for ``previous_response_id`` (per process, oldest dropped first)."""


class Kept(msgspec.Struct):
    """A stored conversation: the slot it ran on and its messages (chat shape)."""

    slot: str
    messages: list[dict[str, Any]]


class Conversations:
    """``response id -> Kept``, at most :data:`MAX_KEPT`, least recently used dropped first."""

    def __init__(self, limit: int = MAX_KEPT) -> None:
        self.limit = limit
        self.items: OrderedDict[str, Kept] = OrderedDict()

    def get(self, response_id: str) -> Kept:
        """The conversation of ``response_id``; ``NOT_FOUND`` when unknown (or dropped)."""
        kept = self.items.get(response_id)
        if kept is None:
            raise ApiError(
                ErrorCode.NOT_FOUND,
                f"Previous response with id '{response_id}' not found (this server keeps the last "
                f"{self.limit} responses in memory)",
            )
        self.items.move_to_end(response_id)
        return kept

    def put(self, response_id: str, kept: Kept) -> None:
        """Keep ``kept`` under ``response_id``, dropping the oldest beyond the limit."""
        self.items[response_id] = kept
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


CONVERSATIONS = Conversations()


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


class Answer:
    """The response object of one request (OpenAI's ``response``), built as output arrives."""

    def __init__(self, data: ResponsesRequest, shape: Shape) -> None:
        self.data = data
        self.shape = shape
        self.id = "resp_" + secrets.token_hex(24)
        self.msg_id = "msg_" + secrets.token_hex(24)
        self.created = int(time.time())
        self.output: list[OutputItem] = []
        self.usage: ResponseUsage | None = None
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None

    def message(self, text: str, status: str = "completed") -> MessageItem:
        """The ``message`` output item holding ``text`` (no part while in progress)."""
        content = [OutputText(text=text)] if status == "completed" else []
        return MessageItem(id=self.msg_id, status=status, content=content)

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

    def remember(self, messages: list[dict[str, Any]], text: str | None, calls: list[ToolCall], slot: str) -> None:
        """Keep the conversation (``messages`` plus this answer) for ``previous_response_id``."""
        if not self.data.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            reply["tool_calls"] = [c.openai() for c in calls]
        CONVERSATIONS.put(self.id, Kept(slot, [*messages, reply]))


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
        "response_format": _response_format(data.text),
        "user": data.user,
        "slot_id": slot if slot is not None else data.slot_id,
        "stream": data.stream,
        "timings_per_token": data.timings_per_token,
        "return_progress": data.return_progress,
    }
    try:
        return msgspec.convert({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}") from exc


class ResponsesController(Controller):
    """``POST /v1/responses`` (errors in OpenAI's ``{"error": {...}}`` shape)."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @post(
        ["/v1/responses", "/responses"],
        status_code=200,
        summary="OpenAI Responses API: create a response",
        responses=streamable(ResponseObject),
    )
    async def create(
        self, request: Request[Any, Any, Any], services: Services, data: ResponsesRequest
    ) -> EventStream | ResponseObject:
        before: list[dict[str, Any]] = []
        slot = None
        if data.previous_response_id:
            kept = CONVERSATIONS.get(data.previous_response_id)
            before, slot = kept.messages, kept.slot
        messages = input_messages(data.input, before)
        shape = await chat_shape(services, request, _chat_request(data, messages, slot))
        answer = Answer(data, shape)
        if not data.stream:
            got = await collect(services, shape.req, request)
            text = "".join(t.text for t in got.tokens if not t.is_stop)
            content, calls = shape.tools.parse(text) if shape.tools else (text, [])
            if content or not calls:
                answer.output.append(answer.message(content or ""))
            answer.output += [answer.function_call(c) for c in calls]
            answer.end(got.end)
            answer.remember(messages, content, calls, got.end.slot_id)
            return answer.body()
        run = await started_run(services, shape.req, request)
        return EventStream(_events(answer, run, messages, route_of(request)))


async def _events(answer: Answer, run: Any, messages: list[dict[str, Any]], route: str) -> AsyncIterator[bytes]:
    """The Responses streaming events of one run (module docstring), numbered from 0: text deltas as the
    text arrives, and each tool call's item as soon as its name is known, then its arguments in pieces
    (``response.function_call_arguments.delta``) as :class:`orchestrator.generation.tool_calls.AnswerText`
    reads them."""
    seq = itertools.count()
    shape = answer.shape
    said = AnswerText(list(shape.req.stop_strings), shape.tools)
    text = ""
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

    def out(pieces: list[Piece]) -> list[bytes]:
        nonlocal text
        got: list[bytes] = []
        for piece in pieces:
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
                for b in out(said.finish(ev.stop_string)):
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
                answer.remember(messages, text or None, calls, ev.slot_id)
                final = clock.final(ev)
                yield named_event(ResponseCompleted(sequence_number=next(seq), response=answer.body(), timings=final))
    except Exception as exc:  # the worker failed mid-stream: an error event ends the stream
        err = compat_error_body(report(exc, route))["error"]
        yield named_event(ResponseError(sequence_number=next(seq), code=str(err["code"]), message=err["message"]))
    finally:
        await run.aclose()
