"""OpenAI's Responses API: ``POST /v1/responses`` (and ``/responses``), over the chat path.

Shapes follow OpenAI's API reference ("Responses": create a response, the response object,
streaming events) as the ``openai`` SDK reads them (``client.responses.create`` and
``client.responses.stream``): ``input`` is a text or a list of items (messages with text or
``input_text``/``output_text`` parts, ``function_call`` and ``function_call_output`` items),
``instructions`` a system message put first, ``tools`` flat function tools
(``{"type": "function", "name", "description", "parameters"}``), ``text.format`` the output's
format (``text``, ``json_object``, ``json_schema``), ``max_output_tokens``.  The request becomes
a chat request (:func:`orchestrator.api.openai.chat_shape`: the model's template, tool calls by
:mod:`orchestrator.generation.tool_plan`; llama-server's reasoning fields as there); the answer is a
``reasoning`` output item when a thinking template thought (llama-server's: one ``reasoning_text`` part),
a ``message`` output item with one ``output_text`` part, and one ``function_call`` item per tool call.

Streaming sends ``event: <type>`` / ``data: {json}`` Server-Sent Events, each with a
``sequence_number``: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, (``response.reasoning_text.delta``..., ``response.reasoning_text.done``)
or (``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``) or (``response.function_call_arguments.delta``... as the
arguments arrive, ``response.function_call_arguments.done``), ``response.output_item.done``, and last
``response.completed`` (also when ``max_output_tokens`` ended the answer: its response then has
``status: "incomplete"``, as the SDK's ``responses.stream`` needs ``response.completed`` and as
llama-server sends it), or ``error`` if the engine failed mid-way.  No ``[DONE]`` line: the
Responses API has none.

``previous_response_id`` continues a conversation: each stored response's conversation (its
messages, without ``instructions``, as OpenAI does not carry them over) and the slot it ran on
are kept in the state store beside the slots (:mod:`orchestrator.slots.conversations`), so the
continuation runs on the same slot and reuses its KV cache for the shared prefix, on any node and
after a restart.  A response belongs to its caller's tenant: another tenant's id, like an unknown
or expired one, is ``NOT_FOUND``.  ``store: false`` keeps nothing.  Not supported: ``background``, ``conversation``,
``item_reference`` items, non-text content (400), retrieving or deleting stored responses.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post

from contract.errors import ErrorCode
from orchestrator.api.common.run import COMPAT_ERRORS, collect, started_run
from orchestrator.api.openai.responses.protocol import ResponseObject, ResponsesRequest
from orchestrator.api.openai.responses.serving import Answer, _chat_request, _events, input_messages
from orchestrator.api.openai.serving import chat_shape
from orchestrator.services import Services
from orchestrator.tenants.principal import principal_of
from orchestrator.web.errors import ApiError, route_of
from orchestrator.web.sse import EventStream, streamable


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
            kept = await services.registry.conversations.get(principal_of(request).tenant, data.previous_response_id)
            if kept is None:
                raise ApiError(
                    ErrorCode.NOT_FOUND, f"Previous response with id '{data.previous_response_id}' not found"
                )
            before, slot = kept.messages, kept.slot
        messages = input_messages(data.input, before)
        shape = await chat_shape(services, request, _chat_request(data, messages, slot))
        answer = Answer(data, shape, services.registry.conversations, principal_of(request).tenant)
        if not data.stream:
            got = await collect(services, shape.req, request)
            whole = shape.answer_text([]).whole([t.text for t in got.tokens if not t.is_stop])
            content, calls = whole.content, whole.calls
            if whole.reasoning:
                answer.output.append(answer.thought(whole.reasoning))
            if content or not calls:
                answer.output.append(answer.message(content or ""))
            answer.output += [answer.function_call(c) for c in calls]
            answer.end(got.end)
            await answer.remember(messages, content, calls, got.end.slot_id, whole.reasoning)
            return answer.body()
        run = await started_run(services, shape.req, request)
        return EventStream(_events(answer, run, messages, route_of(request)))
