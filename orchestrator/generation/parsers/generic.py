"""The generic JSON tool format, for templates without tool support (SmolLM2, this project's default):
the tools are described in a system message and the whole answer is JSON, ``{"tool_call": {"name",
"arguments"}}``, ``{"tool_calls": [...]}`` (``parallel_tool_calls``) or ``{"response": "..."}`` (the
model answers in text), as llama.cpp's former ``generic`` chat format did
(``common_chat_params_init_generic`` with minja's tool polyfills, llama.cpp before the auto-parser)."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from orchestrator.generation.chat_template import message_text
from orchestrator.generation.json_scan import Span
from orchestrator.generation.parsers.base import CALL_RULE, Grammar, call_schema, object_arguments, register
from orchestrator.generation.parsers.json_calls import JsonCallParser
from orchestrator.generation.tool_calls import Tool

GENERIC_INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
    "reply to the user's request"
)  # llama.cpp's generic chat format, verbatim


@register("generic")
class GenericParser(JsonCallParser):
    """The answer is one JSON object: calls under ``tool_call`` / ``tool_calls``; the text of
    ``{"response": "..."}`` streams as content as it is decoded."""

    rank: ClassVar[int] = 90
    first_mode: ClassVar[str] = "json"
    response_key: ClassVar[str | None] = "response"
    always_active: ClassVar[bool] = True

    @classmethod
    def matches(cls, template: str) -> bool:
        """A template that never reads ``tools``."""
        return not re.search(r"\btools\b", template)

    @classmethod
    def template_tools(cls, tools: list[Tool]) -> list[dict[str, Any]] | None:
        """None: the tools are described in a system message (:meth:`prompt_messages`)."""
        return None

    @classmethod
    def prompt_messages(
        cls, messages: list[dict[str, Any]], tools: list[Tool], active: bool, parallel: bool
    ) -> list[dict[str, Any]]:
        """Calls and results written as JSON text, and (``active``) the tools described in the system message."""
        out = [_generic_message(m) for m in messages]
        if active:
            call = {"name": tools[0].name, "arguments": {}} if tools else {}
            example = {"tool_calls": [call]} if parallel else {"tool_call": call}
            system = (
                "You can call any of the following tools to satisfy the user's requests: "
                + json.dumps([t.openai() for t in tools], indent=2)
                + "\n\n"
                + GENERIC_INSTRUCTION
                + ". Example: "
                + json.dumps(example)
            )
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{message_text(out[0].get('content'))}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out

    @classmethod
    def grammar(cls, tools: list[Tool], choice: str, required: bool, parallel: bool) -> Grammar:
        """The whole answer is JSON: a call (``required``), a ``response`` (``none``), or either; never lazy."""
        call = call_schema(tools)
        wrap = (
            {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
             "required": ["tool_calls"]}
            if parallel
            else {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]}
        )  # fmt: skip
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
        schema = wrap if required else answer if choice == "none" else {"anyOf": [wrap, answer]}
        return f"root ::= {CALL_RULE}", schema, []

    def is_call(self, span: Span) -> bool:
        """The object under ``tool_call``, or an object item of ``tool_calls``."""
        path = span.path
        if span.kind != "{":
            return False
        return path == ("tool_call",) or (len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int))


def _generic_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template without tool support: calls and results as JSON text (minja's polyfills)."""
    role = message.get("role")
    if role == "tool":
        result = {
            "tool": message.get("name"),
            "content": message.get("content"),
            "tool_call_id": message.get("tool_call_id"),
        }
        return {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    calls = object_arguments(message).get("tool_calls")
    if role != "assistant" or not calls:
        return message
    if len(calls) == 1:  # as the grammar has the model write one call, so the prompt's prefix is kept
        (call,) = calls
        one = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
        return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": json.dumps({"tool_call": one})}
    listed = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"], "id": c.get("id")} for c in calls
    ]
    text = json.dumps({"tool_calls": listed}, ensure_ascii=False)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": text}
