"""Chat messages to prompt tokens as llama-server does, and its two endpoints that stop there.

:func:`chat_prompt` renders OpenAI ``messages`` with the model's chat template
(:class:`orchestrator.generation.chat_template.ChatTemplate`) under llama-server's rules
(``tools/server/server-common.cpp``, ``oaicompat_chat_params_parse``): a last ``assistant``
message is a prefill that the model continues (rendered without it, then its text appended,
llama-server's ``continue_final_message`` "auto"), and two ``assistant`` messages at the end are
refused with llama-server's message.  ``POST /apply-template`` answers the prompt text
(``{"prompt"}``), ``POST /chat/completions/input_tokens`` (and ``/v1/...``) its token count
(``{"input_tokens"}``), both without generating (llama-server's ``post_apply_template`` and
``handle_count_tokens``).  Both render with :func:`chat_prompt_ids`' preparation, the one the chat
completion path runs (tools, tool calls and results as :mod:`orchestrator.generation.tool_calls`
prepares them), so their text and count are exactly the chat's prompt.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, post

from contract.errors import ErrorCode
from orchestrator.api.compat import COMPAT_ERRORS
from orchestrator.api.llama_server.protocol import AppliedTemplate, ChatPromptBody, InputTokens
from orchestrator.generation.chat_template import ChatTemplate, message_text
from orchestrator.generation.tool_calls import ToolPlan, plan_of
from orchestrator.services import Services
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError


def chat_prompt(services: Services, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """The prompt text of ``messages`` (see the module docstring); ``INVALID_REQUEST`` for
    malformed messages, two ``assistant`` messages at the end, or a template that refuses them."""
    info = services.generation.info
    special = info.special_tokens
    template = ChatTemplate(info.chat_template, str(special.get("bos_token", "")), str(special.get("eos_token", "")))
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles[-2:] == ["assistant", "assistant"]:
        raise ApiError(ErrorCode.INVALID_REQUEST, "Cannot have 2 or more assistant messages at the end of the list.")
    if len(messages) > 1 and roles[-1] == "assistant" and not messages[-1].get("tool_calls"):
        prefill = message_text(messages[-1].get("content"))
        return template.render(messages[:-1], add_generation_prompt=True, tools=tools) + prefill
    return template.render(messages, add_generation_prompt=True, tools=tools)


async def chat_ids(services: Services, text: str) -> list[int]:
    """``text`` (a rendered chat prompt) tokenized; BOS added unless the template wrote it."""
    bos = str(services.generation.info.special_tokens.get("bos_token", ""))
    return (await services.engine.tokenize(text, not (bos and text.startswith(bos)), True)).ids


def named_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each ``tool`` message that has no ``name`` given the name of the call it
    answers: the earlier assistant ``tool_calls`` entry with its ``tool_call_id`` (OpenAI's Chat
    Completions ``tool`` message carries only the id), else, without an id, the call at its place
    among the tool messages after that assistant message.  Messages are not changed in place."""
    names: dict[str, str] = {}
    calls: list[str] = []
    out = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") if isinstance(call, dict) else None
                name = fn.get("name") if isinstance(fn, dict) else None
                if isinstance(name, str):
                    calls.append(name)
                    if isinstance(call.get("id"), str):
                        names[call["id"]] = name
        elif m.get("role") == "tool" and not m.get("name"):
            by_id = names.get(m["tool_call_id"]) if isinstance(m.get("tool_call_id"), str) else None
            name = by_id or (calls.pop(0) if calls and m.get("tool_call_id") is None else None)
            if name:
                m = {**m, "name": name}
        out.append(m)
    return out


def chat_prompt_text(
    services: Services,
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
) -> tuple[str, ToolPlan | None]:
    """The prompt text of a chat body and its tool plan (None without tools): the tool results
    named (:func:`named_tool_results`), the messages and tools prepared by the plan
    (:func:`orchestrator.generation.tool_calls.plan_of`), rendered by :func:`chat_prompt`.  The one
    preparation of the chat completion path, ``/apply-template`` and ``/chat/completions/input_tokens``.
    Raises ``INVALID_REQUEST`` as :func:`chat_prompt` and :func:`plan_of` do."""
    plan = plan_of(services.generation.info.chat_template, tools, tool_choice, parallel_tool_calls)
    named = named_tool_results(messages)
    prepared = plan.messages(named) if plan else named
    return chat_prompt(services, prepared, plan.template_tools() if plan else None), plan


async def chat_prompt_ids(
    services: Services,
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
) -> tuple[list[int], ToolPlan | None]:
    """:func:`chat_prompt_text` tokenized (:func:`chat_ids`): the prompt tokens and the tool plan."""
    text, plan = chat_prompt_text(services, messages, tools, tool_choice, parallel_tool_calls)
    return await chat_ids(services, text), plan


class LlamaChatController(Controller):
    """llama-server's ``/apply-template`` and ``/chat/completions/input_tokens``."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @post(
        "/apply-template",
        status_code=200,
        summary="llama-server: the prompt the chat template makes of messages",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def apply_template(self, services: Services, data: ChatPromptBody) -> AppliedTemplate:
        text, _ = chat_prompt_text(services, data.messages, data.tools, data.tool_choice, data.parallel_tool_calls)
        return AppliedTemplate(prompt=text)

    @post(
        ["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"],
        status_code=200,
        summary="llama-server: the token count of a chat completion's prompt",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def input_tokens(self, services: Services, data: ChatPromptBody) -> InputTokens:
        ids, _ = await chat_prompt_ids(services, data.messages, data.tools, data.tool_choice, data.parallel_tool_calls)
        return InputTokens(input_tokens=len(ids))
