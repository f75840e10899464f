"""Hermes 2 Pro's tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block
per call (Hermes 2 Pro, Qwen 2.5 and Qwen 3, SmolLM3...; llama.cpp's ``common_chat_params_init_hermes_2_pro``
and its auto-parser for these templates, ``common/chat.cpp``)."""

from __future__ import annotations

from typing import ClassVar

from orchestrator.generation.parsers.base import CALL_RULE, Grammar, call_schema, register
from orchestrator.generation.parsers.json_calls import JsonCallParser
from orchestrator.generation.tool_calls import Tool


@register("hermes")
class HermesParser(JsonCallParser):
    """``<tool_call>`` blocks; text around them is content, ``</tool_call>`` is dropped."""

    rank: ClassVar[int] = 10
    marker: ClassVar[str] = "<tool_call>"
    close_tag: ClassVar[str] = "</tool_call>"

    @classmethod
    def matches(cls, template: str) -> bool:
        """A template that writes ``<tool_call>`` with JSON inside (not Qwen3-Coder's ``<function=`` XML)."""
        return "<tool_call>" in template and "<function=" not in template and "<parameter=" not in template

    @classmethod
    def grammar(cls, tools: list[Tool], choice: str, required: bool, parallel: bool) -> Grammar:
        """One block (more with ``parallel``), lazy from ``<tool_call>`` unless a call is required."""
        one = f'"<tool_call>" [ \\n]{{0,2}} {CALL_RULE} [ \\n]{{0,2}} "</tool_call>"'
        more = f' ([ \\n]{{0,2}} "<tool_call>" [ \\n]{{0,2}} {CALL_RULE} [ \\n]{{0,2}} "</tool_call>")*'
        return f"root ::= {one}{more if parallel else ''}", call_schema(tools), [] if required else ["<tool_call>"]
