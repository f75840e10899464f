"""Thinking on llama-server's ``/completion``: its thinking budget fields, and thoughts split out on request.

llama-server reads ``reasoning_budget_tokens``, ``reasoning_budget_start_tag``,
``reasoning_budget_end_tag(s)`` and ``reasoning_budget_message`` on every completion
(``tools/server/server-schema.cpp``); its chat path fills the tags from the template, a raw
``/completion`` gets a budget only with tags given.  Here the tags default to the chat template's
(:func:`orchestrator.generation.parsers.reasoning.thinking_tags`), so a prompt rendered with the
template (``/apply-template``) gets ``--reasoning-budget`` and a request's budget as the chat path does.
``/completion`` returns the generated text as it is (llama-server's); ``reasoning_format`` ``auto`` or
``deepseek`` (slotserve's) moves the thought into ``reasoning_content``.
"""

from __future__ import annotations

from orchestrator.api.common.completion import CompletionBody
from orchestrator.generation.parsers.reasoning import (
    ReasoningPlan,
    ThinkingTags,
    opened_by,
    reasoning_format_of,
    thinking_tags,
)
from orchestrator.services import Services


async def completion_reasoning(services: Services, body: CompletionBody, ids: list[int]) -> ReasoningPlan | None:
    """The reasoning handling of a ``/completion`` prompt ``ids`` (module docstring), or None (no budget and
    no split, or no tags known).  An unknown ``reasoning_format`` is ``INVALID_REQUEST``."""
    settings = services.settings
    fmt = reasoning_format_of(body.reasoning_format, "none")
    budget = body.reasoning_budget_tokens
    if budget is None or budget == -1:
        budget = settings.reasoning_budget
    if fmt == "none" and budget < 0:
        return None
    tags = thinking_tags(services.generation.info.chat_template)
    if body.reasoning_budget_start_tag and body.reasoning_budget_end_tag:
        tags = ThinkingTags(body.reasoning_budget_start_tag, body.reasoning_budget_end_tag)
    if tags is None:
        return None
    message = body.reasoning_budget_message
    message = settings.reasoning_budget_message if message is None else message
    opened = opened_by(await services.engine.detokenize(ids), tags)
    return ReasoningPlan(tags, opened, fmt != "none", budget, message)
