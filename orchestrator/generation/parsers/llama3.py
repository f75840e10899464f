"""Llama 3.1-3.3's JSON tool calls: ``{"name": ..., "parameters": {...}}`` as the whole message, optionally
after ``<|python_tag|>`` (llama.cpp's ``common_chat_params_init_llama_3_x``, ``common/chat.cpp``)."""

from __future__ import annotations

from typing import ClassVar

from orchestrator.generation.parsers.base import CALL_RULE, Grammar, call_schema, register
from orchestrator.generation.parsers.json_calls import JsonCallParser
from orchestrator.generation.tool_calls import Tool

PYTHON_TAG = "<|python_tag|>"


@register("llama3")
class Llama3Parser(JsonCallParser):
    """An answer that starts (after spaces) with ``<|python_tag|>`` or ``{`` is held until it is known to
    be a call (``{"name": ...}`` with its ``parameters``); otherwise it is content."""

    rank: ClassVar[int] = 30
    first_mode: ClassVar[str] = "start"

    @classmethod
    def matches(cls, template: str) -> bool:
        """A Llama 3 header template that knows ``<|python_tag|>`` or the ``ipython`` role."""
        return "<|start_header_id|>" in template and (PYTHON_TAG in template or "ipython" in template)

    @classmethod
    def grammar(cls, tools: list[Tool], choice: str, required: bool, parallel: bool) -> Grammar:
        """The whole answer is one call, ``parameters`` for the arguments; lazy from an opening ``{"name"``."""
        triggers = [] if required else [r'^\s*((?:<\|python_tag\|>)?\{\s*"name")[\s\S]*$']
        return f'root ::= "<|python_tag|>"? {CALL_RULE}', call_schema(tools, "parameters"), triggers

    def _start(self, final: bool) -> None:
        """Decide whether the answer is a call from how it starts."""
        lead = self.buf.lstrip()
        if lead.startswith(PYTHON_TAG):
            cut = len(self.buf) - len(lead) + len(PYTHON_TAG)
            self._start_scan(self.buf[:cut], self.buf[cut:])
        elif lead.startswith("{"):
            cut = len(self.buf) - len(lead)
            self._start_scan(self.buf[:cut], lead)
        elif lead and not PYTHON_TAG.startswith(lead):
            self.mode = "plain"
