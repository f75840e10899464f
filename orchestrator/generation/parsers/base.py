"""The interface every output parser has, and the registry of tool-call formats.

As vLLM's ``vllm/entrypoints/openai/tool_parsers/`` (``ToolParser`` with ``extract_tool_calls`` and
``extract_tool_calls_streaming``, registered by name with ``ToolParserManager``): a parser reads one
answer, streamed (:meth:`OutputParser.feed` then :meth:`OutputParser.finish`) or whole
(:meth:`OutputParser.whole`, the same code fed the text in one piece), and gives out
:data:`orchestrator.generation.pieces.Piece` s.  A tool-call format is one :class:`ToolParser` subclass
in its own module, registered under its name with :func:`register`; :func:`detect` picks the format
of a chat template as llama.cpp's ``common_chat_try_specialized_template`` (``common/chat.cpp``) does,
from markers in its Jinja source.  Nothing outside a format's module knows its syntax.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from contract.errors import ErrorCode
from orchestrator.generation.pieces import Piece
from orchestrator.generation.tool_calls import Tool, ToolCall
from orchestrator.service_error import ServiceError

CALL_RULE = "tc-call"
"""The GBNF rule under which the worker adds the calls' JSON schema (:func:`engine.grammar.gbnf_of`)."""

Grammar = tuple[str, dict[str, Any], list[str]]
"""``(gbnf, json_schema, triggers)``: a GBNF whose :data:`CALL_RULE` is the JSON schema's grammar, and
the regexes that make it lazy (llama-server's ``grammar_triggers``; none: it holds from the start)."""


class OutputParser(ABC):
    """Reads one answer and gives out its pieces as soon as they are certain.

    ``feed(text)`` returns the pieces that ``text``, after what was fed before, makes certain, in order;
    ``finish()`` the rest at the end of the answer.  The pieces of a whole answer are those of the same
    text fed in one piece (:meth:`whole`), so streamed and whole answers agree.
    """

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` makes certain."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The pieces left at the end of the answer (held text, a call or a thought cut short)."""

    def whole(self, text: str) -> list[Piece]:
        """The pieces of a whole answer ``text``."""
        return self.feed(text) + self.finish()


class ToolParser(OutputParser):
    """One tool-call format: how its template is recognised, how tools and calls reach its prompt,
    the grammar that constrains its calls, and how calls are read back from its answers.

    Class-level methods describe the format; an instance reads one answer (:class:`OutputParser`) and
    keeps the calls given out so far in :attr:`calls`.  ``tools``: the request's tools; ``parallel``:
    ``parallel_tool_calls``.
    """

    name: ClassVar[str]
    rank: ClassVar[int] = 50
    """Detection order: lower ranks are tried first (a catch-all format ranks last)."""
    always_active: ClassVar[bool] = False
    """Whether the output is parsed (and constrained) even with ``tool_choice: none`` (the format keeps the
    tools described in the prompt then, so a conversation's prompt keeps its prefix)."""

    def __init__(self, tools: list[Tool], parallel: bool) -> None:
        self.tools = tools
        self.parallel = parallel
        self.calls: list[ToolCall] = []

    @classmethod
    @abstractmethod
    def matches(cls, template: str) -> bool:
        """Whether chat template source ``template`` writes tool calls in this format."""

    @classmethod
    def template_tools(cls, tools: list[Tool]) -> list[dict[str, Any]] | None:
        """The template's ``tools`` variable (Chat Completions' shape; None: the format describes them itself)."""
        return [t.openai() for t in tools] if tools else None

    @classmethod
    def prompt_messages(
        cls, messages: list[dict[str, Any]], tools: list[Tool], active: bool, parallel: bool
    ) -> list[dict[str, Any]]:
        """``messages`` as the template should see them: assistant ``tool_calls`` with their ``arguments``
        as objects (llama.cpp's ``func_args_not_string``: templates ``tojson`` them).  Raises
        ``INVALID_REQUEST`` for a call without ``function.name`` or with arguments that are not JSON."""
        return [object_arguments(m) for m in messages]

    @classmethod
    @abstractmethod
    def grammar(cls, tools: list[Tool], choice: str, required: bool, parallel: bool) -> Grammar:
        """The grammar of this format's calls to ``tools`` (lazy unless ``required``); ``choice`` is
        :func:`orchestrator.generation.tool_calls.choice_of`'s value."""


_FORMATS: dict[str, type[ToolParser]] = {}


def register(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: register a :class:`ToolParser` under ``name`` (detection tries formats by
    :attr:`ToolParser.rank`)."""

    def add(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        _FORMATS[name] = cls
        return cls

    return add


UNKNOWN = "unknown"
"""The format of a template that renders tools in a form no registered parser reads."""


def detect(template: str) -> str:
    """The tool-call format of chat template source ``template``: a registered name, or :data:`UNKNOWN`."""
    ranked = sorted(_FORMATS.values(), key=lambda cls: cls.rank)
    return next((cls.name for cls in ranked if cls.matches(template)), UNKNOWN)


def parser_class(name: str) -> type[ToolParser] | None:
    """The parser registered as ``name`` (None for :data:`UNKNOWN` or an unregistered name)."""
    return _FORMATS.get(name)


def call_schema(tools: list[Tool], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools``: ``{"name": <const>, args_key: <parameters>}``."""
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: t.parameters},
            "required": ["name", args_key],
        }
        for t in tools
    ]
    return one[0] if len(one) == 1 else {"anyOf": one}


def object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` with ``arguments`` as objects (templates ``tojson`` them);
    ``INVALID_REQUEST`` for a call without ``function.name`` or with arguments that are not JSON."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    fixed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ServiceError(ErrorCode.INVALID_REQUEST, "each tool call needs function.name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"tool call arguments are not JSON: {exc}") from exc
        fixed.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": fixed}
