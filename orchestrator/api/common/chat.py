"""A chat request's prompt: its messages (and tools) rendered by the model's chat template and tokenized,
shared by every chat surface (OpenAI, Anthropic, Ollama, llama-server's ``/apply-template`` and
``/chat/completions/input_tokens``), and how its thoughts are handled (:func:`reasoning_of`).
:func:`chat_prompt_text` is the one preparation they all run (tool results named, messages and tools
prepared by :mod:`orchestrator.generation.tool_plan`, rendered by :func:`chat_prompt`), so the text and the
token count ``/apply-template`` and ``input_tokens`` answer are exactly the chat path's prompt."""

from __future__ import annotations

from typing import Any

from contract.errors import ErrorCode
from orchestrator.generation.chat_template import ChatTemplate, message_text
from orchestrator.generation.parsers.reasoning import ReasoningPlan, reasoning_format_of, reasoning_plan
from orchestrator.generation.tool_plan import ToolPlan, plan_of
from orchestrator.services import Services
from orchestrator.web.errors import ApiError


def chat_prompt(
    services: Services,
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    variables: dict[str, Any] | None = None,
) -> str:
    """The prompt text of ``messages`` (see the module docstring), ``variables`` given to the template
    (:meth:`ChatTemplate.render`); ``INVALID_REQUEST`` for malformed messages, two ``assistant`` messages at
    the end, or a template that refuses them."""
    info = services.generation.info
    special = info.special_tokens
    template = ChatTemplate(info.chat_template, str(special.get("bos_token", "")), str(special.get("eos_token", "")))
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles[-2:] == ["assistant", "assistant"]:
        raise ApiError(ErrorCode.INVALID_REQUEST, "Cannot have 2 or more assistant messages at the end of the list.")
    if len(messages) > 1 and roles[-1] == "assistant" and not messages[-1].get("tool_calls"):
        prefill = message_text(messages[-1].get("content"))
        return template.render(messages[:-1], add_generation_prompt=True, tools=tools, variables=variables) + prefill
    return template.render(messages, add_generation_prompt=True, tools=tools, variables=variables)


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
    variables: dict[str, Any] | None = None,
) -> tuple[str, ToolPlan | None]:
    """The prompt text of a chat request (``messages``, ``tools``, ``tool_choice``, ``parallel_tool_calls``
    in OpenAI's shapes; ``variables`` for the template) and its tool plan: the tool results named
    (:func:`named_tool_results`), the messages and tools prepared by the plan
    (:func:`orchestrator.generation.tool_plan.plan_of`; None without tools), rendered by :func:`chat_prompt`.
    Raises ``INVALID_REQUEST`` as they do (``tool_choice`` ``required`` or a named function without tools
    among them)."""
    plan = plan_of(services.generation.info.chat_template, tools, tool_choice, parallel_tool_calls)
    named = named_tool_results(messages)
    prepared = plan.messages(named) if plan else named
    return chat_prompt(services, prepared, plan.template_tools() if plan else None, variables), plan


async def chat_prompt_ids(
    services: Services,
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    variables: dict[str, Any] | None = None,
) -> tuple[list[int], ToolPlan | None, str]:
    """:func:`chat_prompt_text` tokenized (:func:`chat_ids`): the prompt tokens, the tool plan and the prompt's
    text."""
    text, plan = chat_prompt_text(services, messages, tools, tool_choice, parallel_tool_calls, variables)
    return await chat_ids(services, text), plan, text


def reasoning_of(
    services: Services, prompt: str, fmt: str | None, budget: int | None, message: str | None
) -> ReasoningPlan | None:
    """The reasoning handling of a chat request whose rendered prompt is ``prompt`` (None when the template
    has no thinking tags), as llama-server reads it (``tools/server/server-common.cpp``): ``fmt`` its
    ``reasoning_format`` (None: ``--reasoning-format``), ``budget`` its thinking budget in tokens (None or
    -1: ``--reasoning-budget``), ``message`` its ``reasoning_budget_message`` (None:
    ``--reasoning-budget-message``).  An unknown ``reasoning_format`` is ``INVALID_REQUEST``."""
    settings = services.settings
    checked = reasoning_format_of(fmt, settings.reasoning_format)
    if budget is None or budget == -1:
        budget = settings.reasoning_budget
    text = settings.reasoning_budget_message if message is None else message
    return reasoning_plan(services.generation.info.chat_template, prompt, checked, budget, text)
