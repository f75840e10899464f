"""A chat request's prompt: its messages (and tools) rendered by the model's chat template and tokenized,
shared by every chat surface (OpenAI, Anthropic, llama-server's ``/apply-template``)."""

from __future__ import annotations

from typing import Any

from contract.errors import ErrorCode
from orchestrator.generation.chat_template import ChatTemplate, message_text
from orchestrator.generation.tool_calls import ToolPlan, plan_of
from orchestrator.services import Services
from orchestrator.web.errors import ApiError


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


async def chat_prompt_ids(
    services: Services,
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
) -> tuple[list[int], ToolPlan | None]:
    """The prompt tokens of a chat request (its ``messages`` and ``tools``, OpenAI's shapes, rendered by
    the model's template: :func:`chat_prompt`) and its tool plan (:func:`orchestrator.generation.tool_calls.plan_of`;
    None without tools; ``tool_choice`` ``required`` or a named function without tools: ``INVALID_REQUEST``)."""
    plan = plan_of(services.generation.info.chat_template, tools, tool_choice, parallel_tool_calls)
    rendered = plan.messages(messages) if plan else messages
    ids = await chat_ids(services, chat_prompt(services, rendered, plan.template_tools() if plan else None))
    return ids, plan
