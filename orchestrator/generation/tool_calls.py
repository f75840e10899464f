"""OpenAI function tools and the calls parsed back from an answer: the types every tool-call module shares.

OpenAI's Chat Completions ``tools`` / ``tool_choice`` (API reference, "Create chat completion") and the
Responses API's flat tools are read here (:func:`parse_tools`, :func:`choice_of`); a call parsed from
the model's answer is a :class:`ToolCall` (``{"id", "type": "function", "function": {"name",
"arguments"}}`` with ``arguments`` a JSON string).  How a request's tools reach the prompt and the
grammar is :mod:`orchestrator.generation.tool_plan`; how each model family writes a call is one
parser per format in :mod:`orchestrator.generation.parsers`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError


@dataclass(frozen=True)
class Tool:
    """One function tool: ``name``, ``description`` and ``parameters`` (a JSON schema object)."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as Chat Completions writes it (what templates read from ``tools``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


_BAD_NAME = re.compile(r'["\\\x00-\x1f\x7f]')
_BAD_NAME_MESSAGE = (
    "a function name may not contain quotes, backslashes or control characters (OpenAI's names are letters, "
    "digits, '_' and '-', at most 64)"
)


def parse_tools(tools: list[Any]) -> list[Tool]:
    """Chat Completions ``tools`` (``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``) or the Responses API's flat ``{"type": "function", "name", ...}``.

    An absent or empty ``parameters`` is ``{"type": "object", "properties": {}}`` (llama.cpp's
    ``common_chat_tool_parameters``).  Raises ``INVALID_REQUEST`` for anything else, and, naming the tool,
    for a name holding a quote, backslash or control character (the call grammar could not carry it).
    """
    out: list[Tool] = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"unsupported tool (only type 'function'): {tool!r:.200}")
        fn = tool.get("function", tool)
        name, params = (fn.get("name"), fn.get("parameters")) if isinstance(fn, dict) else (None, None)
        if not isinstance(name, str) or not name:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "each function tool needs a non-empty string 'name'")
        if _BAD_NAME.search(name):
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"tool {name!r}: {_BAD_NAME_MESSAGE}")
        if params is not None and not isinstance(params, dict):
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"tool {name}: 'parameters' must be a JSON schema object")
        if not params:
            params = {"type": "object", "properties": {}}
        description = fn.get("description") or ""
        out.append(Tool(name, description if isinstance(description, str) else "", params))
    return out


def choice_of(tool_choice: Any) -> str:
    """``tool_choice``: ``"none"``, ``"auto"``, ``"required"``, or a function's name (from
    ``{"type": "function", "function": {"name"}}`` or the Responses API's ``{"type": "function",
    "name"}``).  Raises ``INVALID_REQUEST`` for other values."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return str(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function", tool_choice)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return "=" + fn["name"]
    raise ServiceError(
        ErrorCode.INVALID_REQUEST,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
    )


def call_id() -> str:
    """A new tool call id (``call_`` and 24 hex digits, as OpenAI's ids look)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """A parsed call: ``name`` and ``arguments`` (JSON text), ``id`` given or made."""

    name: str
    arguments: str
    id: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """As a ``tool_calls`` entry; with ``index``, as a streamed ``delta.tool_calls`` entry."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}
