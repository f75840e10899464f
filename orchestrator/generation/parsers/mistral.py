"""Mistral's tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral Nemo / Small;
llama.cpp's ``common_chat_params_init_mistral_nemo``, ``common/chat.cpp``)."""

from __future__ import annotations

from typing import Any, ClassVar

from orchestrator.generation.json_scan import Span
from orchestrator.generation.parsers.base import CALL_RULE, Grammar, call_schema, register
from orchestrator.generation.parsers.json_calls import JsonCallParser
from orchestrator.generation.tool_calls import Tool


@register("mistral")
class MistralParser(JsonCallParser):
    """``[TOOL_CALLS]`` then a JSON array of calls (or one call object); text before it is content."""

    rank: ClassVar[int] = 20
    marker: ClassVar[str] = "[TOOL_CALLS]"

    @classmethod
    def matches(cls, template: str) -> bool:
        """A template that writes ``[TOOL_CALLS]``."""
        return "[TOOL_CALLS]" in template

    @classmethod
    def grammar(cls, tools: list[Tool], choice: str, required: bool, parallel: bool) -> Grammar:
        """The array (one item unless ``parallel``), lazy from ``[TOOL_CALLS]`` unless a call is required."""
        calls: dict[str, Any] = {"type": "array", "items": call_schema(tools), "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        return f'root ::= "[TOOL_CALLS]" {CALL_RULE}', calls, [] if required else [r"\[TOOL_CALLS\]"]

    def is_call(self, span: Span) -> bool:
        """The top-level object, or an object item of the top-level array."""
        path = span.path
        return span.kind == "{" and (path == () or (len(path) == 1 and isinstance(path[0], int)))
