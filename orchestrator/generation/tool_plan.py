"""The tool handling of one chat request: prompt, grammar, and which parser reads the answer.

OpenAI's Chat Completions ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (API reference,
"Create chat completion") become, as llama-server's ``--jinja`` mode does (``common/chat.cpp`` and
``common/chat-auto-parser*.cpp`` of the pinned llama.cpp):

* the prompt: the tools are passed to the template as its ``tools`` variable and the history's calls
  and results shaped as the template's format expects (each format's
  :meth:`~orchestrator.generation.parsers.base.ToolParser.prompt_messages`);
* a grammar (llama.cpp's GBNF, built by the worker from the tools' JSON schemas, see
  :func:`engine.grammar.gbnf_of`): for ``tool_choice`` ``"required"`` or a named function a full
  grammar that only allows calls; for ``"auto"`` a lazy one triggered by the format's call marker
  (llama-server's ``grammar_lazy`` / ``grammar_triggers``);
* the output read back into OpenAI ``tool_calls`` by the format's parser.

The format is picked from the template's source (:func:`orchestrator.generation.parsers.base.detect`):
one of the registered parsers (:mod:`orchestrator.generation.parsers`), or ``unknown`` (Qwen3-Coder's
XML, Functionary, GPT-OSS's channels...): then ``tool_choice`` ``"required"`` or a named function is
refused with ``INVALID_REQUEST`` (400), and ``"auto"`` renders the tools and answers text.
"""

from __future__ import annotations

import json
from typing import Any

import orchestrator.generation.parsers  # noqa: F401  (importing the package registers the built-in formats)
from contract.errors import ErrorCode
from orchestrator.generation.parsers.base import CALL_RULE, UNKNOWN, Grammar, ToolParser, detect, parser_class
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.tool_calls import Tool, ToolCall, choice_of, parse_tools
from orchestrator.service_error import ServiceError


class ToolPlan:
    """The tool handling of one chat request (module docstring).

    ``template``: the model's chat template source; ``tools``: parsed :class:`Tool` s;
    ``choice``: :func:`choice_of`'s value; ``parallel``: ``parallel_tool_calls`` (llama-server's
    default is false: one call per answer).  Raises ``INVALID_REQUEST`` for a named function
    not in ``tools`` or where a call is required but the template's format is ``unknown``.
    """

    def __init__(self, template: str, tools: list[Tool], choice: str, parallel: bool) -> None:
        self.format = detect(template)
        self.parser = parser_class(self.format)
        self.tools = tools
        self.choice = choice
        self.parallel = parallel
        if choice.startswith("="):
            wanted = choice[1:]
            self.tools = [t for t in tools if t.name == wanted]
            if not self.tools:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"tool_choice names {wanted!r}, which is not in tools")
        self.required = choice == "required" or choice.startswith("=")
        if self.required and self.format == UNKNOWN:
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                "this model's chat template writes tool calls in a format this server cannot parse "
                "(supported: Hermes <tool_call>, Mistral [TOOL_CALLS], Llama 3.x JSON, or a template "
                "without tools); tool_choice 'required' or a named function cannot be honoured",
            )

    @property
    def active(self) -> bool:
        """Whether the output is constrained and parsed: a known format and ``tool_choice`` not ``none``
        (a format that is ``always_active`` also with ``none``: the tools stay described, so a
        conversation's prompt keeps its prefix and cache, and the grammar allows only text answers)."""
        if self.parser is None or not self.tools:
            return False
        return self.parser.always_active or self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` variable for the template (None when the format describes them itself)."""
        if self.parser is None:
            return [t.openai() for t in self.tools] if self.tools else None
        return self.parser.template_tools(self.tools)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as the template should see them (the format's ``prompt_messages``)."""
        parser = self.parser or ToolParser
        return parser.prompt_messages(messages, self.tools, self.active, self.parallel)

    def grammar(self) -> Grammar | None:
        """``(gbnf, json_schema, triggers)`` to constrain the output with, or None: the GBNF's
        :data:`CALL_RULE` is the JSON schema's grammar (:func:`engine.grammar.gbnf_of`); with
        ``triggers`` (regexes) the grammar is lazy (``tool_choice`` ``auto``)."""
        if not self.active or self.parser is None:
            return None
        return self.parser.grammar(self.tools, self.choice, self.required, self.parallel)

    def constrain(self, req: CanonicalRequest) -> None:
        """Set :meth:`grammar` on ``req``; ``INVALID_REQUEST`` when it already has a grammar, JSON
        schema or ``response_format`` (llama-server: "Cannot specify grammar with tools")."""
        got = self.grammar()
        if got is None:
            return
        if req.grammar or req.json_schema:
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                "Cannot specify grammar with tools (grammar, json_schema or response_format with tool_choice "
                "other than 'none')",
            )
        req.grammar, schema, req.grammar_triggers = got
        req.json_schema = json.dumps(schema)
        req.schema_rule = CALL_RULE

    def splitter(self) -> ToolParser:
        """A parser for one answer of this plan (an :attr:`active` one: an inactive plan's output is text)."""
        if not self.active or self.parser is None:
            raise ValueError("an inactive tool plan reads no calls")
        return self.parser(self.tools, self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole answer, read by the same parser as a streamed one.  With calls,
        ``content`` is the text around them stripped (None when empty); without, the text as it was."""
        if not self.active:
            return text, []
        split = self.splitter()
        pieces = split.whole(text)
        content = "".join(p for p in pieces if isinstance(p, str))
        if split.calls:
            return content.strip() or None, split.calls
        return content, []


def plan_of(template: str, tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The :class:`ToolPlan` of a request, or None when it has no tools (then ``tool_choice``
    ``required`` or a named function is ``INVALID_REQUEST``: there is nothing to call)."""
    choice = choice_of(tool_choice)
    if not tools:
        if choice == "required" or choice.startswith("="):
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"tool_choice {tool_choice!r} needs tools")
        return None
    return ToolPlan(template, parse_tools(tools), choice, bool(parallel))
