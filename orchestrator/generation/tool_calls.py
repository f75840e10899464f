"""OpenAI tool calls over a model's own chat template: prompt, grammar, and output parsing.

OpenAI's Chat Completions ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (API reference,
"Create chat completion") become, as llama-server's ``--jinja`` mode does (``common/chat.cpp``
and ``common/chat-auto-parser*.cpp`` of the pinned llama.cpp):

* the prompt: the tools are passed to the template as its ``tools`` variable, assistant
  ``tool_calls`` with their ``arguments`` as objects (llama.cpp's ``func_args_not_string``)
  and ``tool`` messages as they are; a template that never reads ``tools`` gets them described
  in a system message instead, with earlier calls and results written as JSON, as llama.cpp's
  former ``generic`` chat format did (``common_chat_params_init_generic`` with minja's tool
  polyfills, llama.cpp before the auto-parser);
* a grammar (llama.cpp's GBNF, built by the worker from the tools' JSON schemas, see
  :func:`engine.grammar.gbnf_of`): for ``tool_choice`` ``"required"`` or a named function a
  full grammar that only allows calls; for ``"auto"`` a lazy one triggered by the format's
  call marker (llama-server's ``grammar_lazy`` / ``grammar_triggers``);
* the output parsed back into OpenAI ``tool_calls`` (``{"id", "type": "function",
  "function": {"name", "arguments"}}`` with ``arguments`` a JSON string).

Formats (:class:`ToolFormat`), picked from the template's source as llama.cpp's
``common_chat_try_specialized_template`` does:

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
  call (Hermes 2 Pro, Qwen 2.5 and Qwen 3, SmolLM3...);
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral Nemo / Small);
* ``llama3``: ``{"name": ..., "parameters": {...}}`` as the whole message, optionally after
  ``<|python_tag|>`` (Llama 3.1-3.3's JSON tool calling);
* ``generic``: the whole message is JSON, ``{"tool_call": {"name", "arguments"}}``,
  ``{"tool_calls": [...]}`` (``parallel_tool_calls``) or ``{"response": "..."}`` (the model
  answers in text); for templates without tool support (SmolLM2, this project's default);
* ``unknown``: the template renders tools in a form this module cannot parse (Qwen3-Coder's
  XML, Functionary, GPT-OSS's channels...): ``tool_choice`` ``"required"`` or a named
  function is refused with ``INVALID_REQUEST`` (400); ``"auto"`` renders the tools and answers text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from contract.errors import ErrorCode
from orchestrator.generation.chat_template import message_text
from orchestrator.generation.json_scan import JsonScan, Span
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.service_error import ServiceError

CALL_RULE = "tc-call"  # the GBNF rule under which the worker adds the calls' JSON schema
GENERIC_INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
    "reply to the user's request"
)  # llama.cpp's generic chat format, verbatim


class ToolFormat(StrEnum):
    """How a model writes a tool call (module docstring)."""

    HERMES = "hermes"
    MISTRAL = "mistral"
    LLAMA3 = "llama3"
    GENERIC = "generic"
    UNKNOWN = "unknown"


def detect_format(template: str) -> ToolFormat:
    """The tool-call format of a chat template, from markers in its Jinja source."""
    if "<tool_call>" in template:
        if "<function=" in template or "<parameter=" in template:  # Qwen3-Coder's XML arguments
            return ToolFormat.UNKNOWN
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in template:
        return ToolFormat.MISTRAL
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or "ipython" in template):
        return ToolFormat.LLAMA3
    if not re.search(r"\btools\b", template):
        return ToolFormat.GENERIC
    return ToolFormat.UNKNOWN


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


class ToolPlan:
    """The tool handling of one chat request (module docstring).

    ``template``: the model's chat template source; ``tools``: parsed :class:`Tool` s;
    ``choice``: :func:`choice_of`'s value; ``parallel``: ``parallel_tool_calls`` (llama-server's
    default is false: one call per answer).  Raises ``INVALID_REQUEST`` for a named function
    not in ``tools`` or where a call is required but the template's format
    is ``unknown``.
    """

    def __init__(self, template: str, tools: list[Tool], choice: str, parallel: bool) -> None:
        self.format = detect_format(template)
        self.tools = tools
        self.choice = choice
        self.parallel = parallel
        if choice.startswith("="):
            wanted = choice[1:]
            self.tools = [t for t in tools if t.name == wanted]
            if not self.tools:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"tool_choice names {wanted!r}, which is not in tools")
        self.required = choice == "required" or choice.startswith("=")
        if self.required and self.format == ToolFormat.UNKNOWN:
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                "this model's chat template writes tool calls in a format this server cannot parse "
                "(supported: Hermes <tool_call>, Mistral [TOOL_CALLS], Llama 3.x JSON, or a template "
                "without tools); tool_choice 'required' or a named function cannot be honoured",
            )

    @property
    def active(self) -> bool:
        """Whether the output is constrained and parsed: a known format and ``tool_choice`` not ``none``
        (``generic`` also with ``none``: the tools stay described, so a conversation's prompt keeps its
        prefix and cache, and the grammar allows only the ``{"response": ...}`` answer)."""
        if self.format == ToolFormat.GENERIC:
            return bool(self.tools)
        return self.choice != "none" and self.format != ToolFormat.UNKNOWN and bool(self.tools)

    # ------------------------------------------------------------------ prompt

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` variable for the template (None for ``generic``: described in a message)."""
        if self.format == ToolFormat.GENERIC or not self.tools:
            return None
        return [t.openai() for t in self.tools]

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as the template should see them (module docstring)."""
        if self.format != ToolFormat.GENERIC:
            return [_object_arguments(m) for m in messages]
        out = [_generic_message(m) for m in messages]
        if self.active:
            system = (
                "You can call any of the following tools to satisfy the user's requests: "
                + json.dumps([t.openai() for t in self.tools], indent=2)
                + "\n\n"
                + GENERIC_INSTRUCTION
                + ". Example: "
                + json.dumps(self._generic_example())
            )
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{message_text(out[0].get('content'))}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out

    def _generic_example(self) -> dict[str, Any]:
        call = {"name": self.tools[0].name, "arguments": {}} if self.tools else {}
        return {"tool_calls": [call]} if self.parallel else {"tool_call": call}

    # ------------------------------------------------------------------ grammar

    def _call_schema(self, args_key: str = "arguments") -> dict[str, Any]:
        one = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, args_key: t.parameters},
                "required": ["name", args_key],
            }
            for t in self.tools
        ]
        return one[0] if len(one) == 1 else {"anyOf": one}

    def grammar(self) -> tuple[str, dict[str, Any], list[str]] | None:
        """``(gbnf, json_schema, triggers)`` to constrain the output with, or None: the GBNF's
        :data:`CALL_RULE` is the JSON schema's grammar (:func:`engine.grammar.gbnf_of`); with
        ``triggers`` (regexes) the grammar is lazy (``tool_choice`` ``auto``)."""
        if not self.active:
            return None
        call = self._call_schema()
        lazy = not self.required
        if self.format == ToolFormat.GENERIC:  # the whole answer is JSON, as llama.cpp's generic format
            wrap = (
                {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                 "required": ["tool_calls"]}
                if self.parallel
                else {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]}
            )  # fmt: skip
            answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
            schema = wrap if self.required else answer if self.choice == "none" else {"anyOf": [wrap, answer]}
            return f"root ::= {CALL_RULE}", schema, []
        if self.format == ToolFormat.HERMES:
            one = f'"<tool_call>" [ \\n]{{0,2}} {CALL_RULE} [ \\n]{{0,2}} "</tool_call>"'
            more = f' ([ \\n]{{0,2}} "<tool_call>" [ \\n]{{0,2}} {CALL_RULE} [ \\n]{{0,2}} "</tool_call>")*'
            return f"root ::= {one}{more if self.parallel else ''}", call, ["<tool_call>"] if lazy else []
        if self.format == ToolFormat.MISTRAL:
            calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
            if not self.parallel:
                calls["maxItems"] = 1
            return f'root ::= "[TOOL_CALLS]" {CALL_RULE}', calls, [r"\[TOOL_CALLS\]"] if lazy else []
        # llama3: the whole answer is one call, "parameters" for the arguments
        schema = self._call_schema("parameters")
        triggers = [r'^\s*((?:<\|python_tag\|>)?\{\s*"name")[\s\S]*$'] if lazy else []
        return f'root ::= "<|python_tag|>"? {CALL_RULE}', schema, triggers

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

    # ------------------------------------------------------------------ output

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole answer: :class:`ToolStream` fed ``text`` in one piece, so a
        streamed answer and a whole one are parsed by the same code.  With calls, ``content`` is the
        text around them stripped (None when empty); without, the text as it was."""
        if not self.active:
            return text, []
        split = self.splitter()
        pieces = split.feed(text) + split.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        if split.calls:
            return content.strip() or None, split.calls
        return content, []

    def splitter(self) -> ToolStream:
        """A :class:`ToolStream` for this plan's streamed output."""
        return ToolStream(self)


@dataclass
class CallDelta:
    """A piece of a streamed tool call, as llama-server's ``common_chat_msg_diff::tool_call_delta``
    (``common/chat.h``): call ``index``'s first delta has its ``id`` and ``name`` (and ``arguments``
    ""), the next ones pieces of ``arguments`` whose concatenation is the call's arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Piece = str | CallDelta
"""What :class:`ToolStream` gives out: content text, or a :class:`CallDelta`."""

_ARGS_KEYS = ("arguments", "parameters")
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class _Open:
    """A call object being read: its name, id, and its arguments' value (a span of the scan)."""

    span: Span
    name: str | None = None
    id: str | None = None
    args: Span | None = None
    args_text: str = ""  # the arguments as known so far (raw JSON, or a string argument decoded)
    raw_sent: int = 0  # a string argument: the raw index decoded up to
    index: int | None = None  # the call's index once its header went out


class ToolStream:
    """Reads a model's answer as it streams and gives out content and tool-call pieces (:class:`Piece`)
    as soon as they are certain, as llama-server's partial parsing does (``common_chat_parse`` with
    ``is_partial`` and ``common_chat_msg_diff::compute_diffs``, ``common/chat.cpp``; the diffs become
    ``delta.tool_calls`` in ``tools/server/server-task.cpp``).

    * ``hermes`` / ``mistral``: text before the call marker (``<tool_call>`` / ``[TOOL_CALLS]``) is
      content, less a tail that could be the marker's start (held until the next piece says);
      after the marker the calls' JSON is scanned (:class:`JsonScan`): a call's ``{index, id,
      name}`` goes out once its name is read and its arguments have begun, then its arguments'
      JSON text piece by piece, exactly as the model wrote it (a string argument: its decoded
      text), so the pieces concatenate to the call's final ``arguments``.  ``</tool_call>`` and the
      spaces between calls are dropped; other text between or after calls is content.
    * ``llama3``: an answer that starts (after spaces) with ``<|python_tag|>`` or ``{`` is held
      until it is known to be a call (``{"name": ...}`` with its ``parameters``); otherwise it is
      content.
    * ``generic``: the whole answer is JSON; calls under ``tool_call`` / ``tool_calls``, and the
      text of ``{"response": "..."}`` streams as content as it is decoded.

    Text that was held as a possible call but is not JSON, or a call cut short before its arguments
    began, is given out as content; a call cut short (``max_tokens``) after that stays, with the
    arguments it has (as OpenAI's own cut calls do).  :attr:`calls` holds the calls given out so far.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.format = plan.format
        self.calls: list[ToolCall] = []
        self.marker = {ToolFormat.HERMES: "<tool_call>", ToolFormat.MISTRAL: "[TOOL_CALLS]"}.get(plan.format, "")
        self.mode = {ToolFormat.LLAMA3: "start", ToolFormat.GENERIC: "json"}.get(plan.format, "text")
        self.buf = ""  # text read but not yet given out nor consumed
        self.prefix = ""  # text consumed before the scan (a marker), content again if the scan is no call
        self.scan = JsonScan()
        self.open: _Open | None = None
        self.response: Span | None = None  # generic: the "response" string being streamed
        self.response_sent = 0
        self.emitted = False  # whether the current scan gave out anything
        self.out: list[Piece] = []

    # ------------------------------------------------------------------ giving out

    def _content(self, text: str) -> None:
        if text:
            if self.out and isinstance(self.out[-1], str):
                self.out[-1] += text
            else:
                self.out.append(text)

    def _args(self, call: _Open, text: str) -> None:
        assert call.index is not None
        if not text:
            return
        self.calls[call.index].arguments += text
        last = self.out[-1] if self.out else None
        if isinstance(last, CallDelta) and last.index == call.index and last.name is None:
            last.arguments += text
        else:
            self.out.append(CallDelta(call.index, text))

    def _header(self, call: _Open) -> None:
        if call.index is not None or call.name is None:
            return
        call.index = len(self.calls)
        made = ToolCall(call.name, "", call.id or call_id())
        self.calls.append(made)
        self.out.append(CallDelta(call.index, "", made.id, made.name))
        self.emitted = True

    def _take(self) -> list[Piece]:
        out, self.out = self.out, []
        return out

    # ------------------------------------------------------------------ reading

    def feed(self, text: str) -> list[Piece]:
        """The pieces that ``text`` (after what was read before) makes certain, in order."""
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Piece]:
        """The pieces left at the end of the answer (held text, a call cut short)."""
        self._run(final=True)
        if self.mode == "json":
            self._events(self.scan.close())
            if self.scan.done:
                self._scan_done()
            else:
                self._give_up(final=True)
        elif self.mode in ("start", "plain", "text") and (self.buf.strip() or not self.calls):
            self._content(self.buf)  # held text; spaces held after a call are dropped
        self.buf = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while True:
            before = (self.mode, len(self.buf))
            getattr(self, "_" + self.mode)(final)
            if (self.mode, len(self.buf)) == before:
                return

    def _plain(self, final: bool) -> None:
        self._content(self.buf)
        self.buf = ""

    def _text(self, final: bool) -> None:
        if not self.marker:
            self.mode = "plain"
            return
        at = self.buf.find(self.marker)
        if at >= 0:
            self._content(self.buf[:at] if self.buf[:at].strip() or not self.calls else "")
            self._start_scan(self.marker, self.buf[at + len(self.marker) :])
            return
        most = min(len(self.marker) - 1, len(self.buf))
        keep = next((k for k in range(most, 0, -1) if self.marker.startswith(self.buf[-k:])), 0)
        send = self.buf[: len(self.buf) - keep]
        if self.calls and not send.strip():  # spaces after a call: held (dropped if nothing follows)
            return
        self._content(send)
        self.buf = self.buf[len(send) :]

    def _start(self, final: bool) -> None:
        """``llama3``: decide whether the answer is a call from how it starts."""
        lead = self.buf.lstrip()
        if lead.startswith(_PYTHON_TAG):
            cut = len(self.buf) - len(lead) + len(_PYTHON_TAG)
            self._start_scan(self.buf[:cut], self.buf[cut:])
        elif lead.startswith("{"):
            cut = len(self.buf) - len(lead)
            self._start_scan(self.buf[:cut], lead)
        elif lead and not _PYTHON_TAG.startswith(lead):
            self.mode = "plain"

    def _close(self, final: bool) -> None:
        """``hermes``: after a call, its ``</tool_call>`` (and spaces) are dropped."""
        lead = self.buf.lstrip()
        if lead.startswith(_HERMES_CLOSE):
            self.buf = lead[len(_HERMES_CLOSE) :]
            self.mode = "text"
        elif not _HERMES_CLOSE.startswith(lead):
            self.mode = "text"

    def _start_scan(self, prefix: str, rest: str) -> None:
        self.prefix, self.buf = prefix, rest
        self.scan, self.open, self.response, self.emitted = JsonScan(), None, None, False
        self.mode = "json"

    def _json(self, final: bool) -> None:
        self._events(self.scan.feed(self.buf))
        self.buf = ""
        if self.scan.failed:
            self._give_up(final)
        elif self.scan.done:
            self._scan_done()
        else:
            self._progress()

    def _scan_done(self) -> None:
        rest = self.scan.text[self.scan.end :]
        if not self.emitted:  # JSON, but no call: content
            self._content(self.prefix + self.scan.text[: self.scan.end])
        self.buf = rest + self.buf
        done_call = self.format == ToolFormat.HERMES and self.emitted
        self.mode = "close" if done_call else "text" if self.marker else "plain"

    def _give_up(self, final: bool) -> None:
        """The scan failed (not JSON) or the answer ended inside it."""
        if self.open is not None and self.open.index is not None:
            self._progress()  # a call cut short keeps the arguments it has
        elif final and self.response is not None:
            self._response_progress(final=True)
        if not self.emitted:
            self._content(self.prefix + self.scan.text[: self.scan.end])
        self.buf = self.scan.text[self.scan.end :] + self.buf
        self.open = None
        self.mode = "text" if self.marker else "plain"
        if final:
            self._content(self.buf)
            self.buf = ""

    def _is_call(self, span: Span) -> bool:
        path = span.path
        if span.kind != "{":
            return False
        if self.format == ToolFormat.GENERIC:
            return path == ("tool_call",) or (len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int))
        if self.format == ToolFormat.MISTRAL:
            return path == () or (len(path) == 1 and isinstance(path[0], int))
        return path == ()

    def _events(self, events: list[tuple[str, Span]]) -> None:
        text = self.scan.text
        for kind, span in events:
            call = self.open
            if kind == "start":
                if self._is_call(span):
                    self.open = _Open(span)
                elif call is not None and span.path[:-1] == call.span.path and call.args is None:
                    if span.path[-1] in _ARGS_KEYS:
                        call.args, call.raw_sent = span, span.start + 1
                elif self.format == ToolFormat.GENERIC and span.path == ("response",) and span.kind == '"':
                    self.response, self.response_sent = span, span.start + 1
                continue
            assert span.end is not None
            if call is not None and span is call.span:
                self._end_call(call)
            elif call is not None and span is call.args:
                self._args_progress(call, span.end)
            elif call is not None and span.path[:-1] == call.span.path and span.kind == '"':
                key = span.path[-1]
                if key in ("name", "id") and getattr(call, str(key)) is None:
                    setattr(call, str(key), json.loads(text[span.start : span.end]))
            elif span is self.response:
                self._response_progress(final=True)
            elif self.format == ToolFormat.GENERIC and span.path == ("response",):  # not a string: its JSON
                self._content(text[span.start : span.end])
                self.emitted = True

    def _end_call(self, call: _Open) -> None:
        self.open = None
        if call.name is None:
            return  # an object without a name: not a call
        if call.args is None:
            call.args_text = "{}"
        self._header(call)
        self._args(call, call.args_text[len(self.calls[call.index or 0].arguments) :])

    def _progress(self) -> None:
        call = self.open
        if call is not None and call.args is not None and call.args.end is None:  # ended: sent whole then
            self._args_progress(call, None)
        if self.response is not None:
            self._response_progress(final=False)

    def _args_progress(self, call: _Open, end: int | None) -> None:
        """The arguments as far as read (``end``: their end, once read); out once the name is known."""
        args = call.args
        assert args is not None
        text = self.scan.text
        if args.kind != '"':
            call.args_text = text[args.start : end if end is not None else self.scan.pos]
        else:
            upto = end - 1 if end is not None else self.scan.safe
            if upto > call.raw_sent:
                call.args_text += json.loads('"' + text[call.raw_sent : upto] + '"')
                call.raw_sent = upto
        if call.name is not None:
            self._header(call)
            self._args(call, call.args_text[len(self.calls[call.index or 0].arguments) :])

    def _response_progress(self, final: bool) -> None:
        span = self.response
        assert span is not None
        upto = span.end - 1 if span.end is not None else self.scan.safe
        if upto > self.response_sent:
            self._content(json.loads('"' + self.scan.text[self.response_sent : upto] + '"'))
            self.response_sent = upto
            self.emitted = True
        if span.end is not None or final:
            self.response = None


class AnswerText:
    """A streamed answer as its client may see it: stop strings held back and cut (:class:`StopTextFilter`,
    as llama-server never sends them), then, with a ``plan``, tool calls parsed as they arrive
    (:class:`ToolStream`): content text and :class:`CallDelta` pieces (:data:`Piece`)."""

    def __init__(self, stops: list[str], plan: ToolPlan | None) -> None:
        self.stops = StopTextFilter(stops)
        self.split = plan.splitter() if plan is not None else None

    @property
    def calls(self) -> list[ToolCall]:
        """The tool calls given out so far (their arguments as far as they went)."""
        return self.split.calls if self.split is not None else []

    def _pieces(self, text: str) -> list[Piece]:
        if self.split is not None:
            return self.split.feed(text)
        return [text] if text else []

    def feed(self, text: str) -> list[Piece]:
        """The pieces that can be sent now, of ``text`` and what was held."""
        return self._pieces(self.stops.feed(text))

    def finish(self, stop_string: str = "") -> list[Piece]:
        """The pieces left at the end: what was held (cut before ``stop_string``, the stop string that ended
        the generation, if any), a held call completed or given out as content."""
        out = self._pieces(self.stops.finish(stop_string))
        return out + self.split.finish() if self.split is not None else out


def _object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` with ``arguments`` as objects (templates ``tojson`` them)."""
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
    calls = _object_arguments(message).get("tool_calls")
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


def plan_of(template: str, tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The :class:`ToolPlan` of a request, or None when it has no tools (then ``tool_choice``
    ``required`` or a named function is ``INVALID_REQUEST``: there is nothing to call)."""
    choice = choice_of(tool_choice)
    if not tools:
        if choice == "required" or choice.startswith("="):
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"tool_choice {tool_choice!r} needs tools")
        return None
    return ToolPlan(template, parse_tools(tools), choice, bool(parallel))
