"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, over the chat path.

As llama-server does (``tools/server/server-chat.cpp`` ``server_chat_convert_anthropic_to_oai``), the
request becomes an OpenAI-shaped chat request (messages, tools, tool choice:
:func:`orchestrator.api.anthropic.serving.turn_of`, run on
:func:`orchestrator.api.common.chat.chat_prompt_ids`: the model's chat template, tool calls by
:mod:`orchestrator.generation.tool_plan`, the slot by ``slot_id`` / ``X-Slot-Id`` or the server's choice):

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
  ``top_k`` pass through; ``max_tokens`` defaults to 4096 (bounded by the window); ``metadata`` is
  accepted and unused; ``thinking: {"type": "enabled", "budget_tokens"}`` is the thinking budget
  (``thinking_budget_tokens``, 10000 when left out, as llama-server).

The answer is llama-server's ``to_json_anthropic``: ``content`` a ``thinking`` block (a thinking
template's thoughts, split out as ``--reasoning-format`` says, ``signature`` ""), a text block (when there
is text), then one ``tool_use`` block per call; ``stop_reason`` ``tool_use`` when the answer calls tools, ``max_tokens``
when the limit ended it, ``stop_sequence`` when a stop sequence did (Anthropic's value: llama-server
says ``end_turn`` and fills ``stop_sequence``), else ``end_turn``; ``usage`` with
``cache_read_input_tokens``; the id is Anthropic's form ``msg_...``.  Streamed (``stream: true``),
the events are llama-server's ``to_json_anthropic_stream`` (no ``ping``, no ``[DONE]``; thoughts as
``thinking_delta`` pieces, the thinking block closed by an empty ``signature_delta``), each
block closed before the next opens (Anthropic's order; llama-server closes them all at the end);
text and tool calls are read as they stream (:class:`orchestrator.generation.answer_text.AnswerText`,
the OpenAI stream's parser): a ``tool_use`` block starts once its call's name is known and its
``input_json_delta`` pieces are the arguments as the model writes them, as llama-server streams them.
Errors have llama-server's body under Anthropic's ``"type": "error"`` (:class:`MessageError`), the
stream's ``error`` event too.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post

from orchestrator.api.anthropic.protocol import (
    AnswerBlock,
    Message,
    MessagesRequest,
    MessageTokens,
    TextBlock,
    ThinkingBlock,
)
from orchestrator.api.anthropic.serving import (
    ERRORS,
    Answer,
    _events,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    error_body,
    tool_use,
    turn_of,
    usage_of,
)
from orchestrator.api.common.chat import chat_prompt_ids
from orchestrator.api.common.run import collect, started_run
from orchestrator.services import Services
from orchestrator.slots.model import slot_id_out
from orchestrator.web.errors import exception_handlers, route_of
from orchestrator.web.sse import EventStream, streamable


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
        if not data.stream:
            got = await collect(services, shape.req, request)
            read = shape.answer_text().whole([t.text for t in got.tokens if not t.is_stop], got.end.stop_string)
            said, calls = read.content, read.calls
            content: list[AnswerBlock] = [ThinkingBlock(thinking=read.reasoning)] if read.reasoning else []
            content += [TextBlock(text=said)] if said else []
            content += [tool_use(c) for c in calls]
            end = got.end
            usage = usage_of(end.n_prompt, end.n_cached, end.n_generated)
            message = answer.message(content, usage, answer.end(end, calls))
            message.slot_id = slot_id_out(end.slot_id)
            return message
        run = await started_run(services, shape.req, request)
        return EventStream(_events(answer, run, shape.answer_text(), route_of(request)))

    @post(
        "/v1/messages/count_tokens",
        status_code=200,
        summary="Anthropic Messages API: count a message's prompt tokens",
        responses=ERRORS,
    )
    async def count_tokens(self, services: Services, data: MessagesRequest) -> MessageTokens:
        ids, _, _ = await chat_prompt_ids(
            services, chat_messages(data), chat_tools(data.tools), chat_tool_choice(data.tool_choice)
        )
        return MessageTokens(input_tokens=len(ids))
