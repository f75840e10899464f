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

from engine.errors import ErrorCode
from orchestrator.generation.chat_template import message_text
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.service_error import ServiceError

CALL_RULE = "tc-call"  # the GBNF rule under which the worker adds the calls' JSON schema
_JSON = json.JSONDecoder()
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


def parse_tools(tools: list[Any]) -> list[Tool]:
    """Chat Completions ``tools`` (``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``) or the Responses API's flat ``{"type": "function", "name", ...}``.

    An absent or empty ``parameters`` is ``{"type": "object", "properties": {}}`` (llama.cpp's
    ``common_chat_tool_parameters``).  Raises ``INVALID_REQUEST`` for anything else.
    """
    out: list[Tool] = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"unsupported tool (only type 'function'): {tool!r:.200}")
        fn = tool.get("function", tool)
        name, params = (fn.get("name"), fn.get("parameters")) if isinstance(fn, dict) else (None, None)
        if not isinstance(name, str) or not name:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "each function tool needs a non-empty string 'name'")
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


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    given = obj.get("id")
    return ToolCall(obj["name"], text, given if isinstance(given, str) and given else call_id())


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after spaces) and the index after it, or None."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    try:
        return _JSON.raw_decode(text, pos)
    except ValueError:
        return None


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
        """``(content, calls)`` of a whole answer; text that holds no well-formed call is content."""
        if not self.active:
            return text, []
        if self.format == ToolFormat.HERMES:
            return _parse_hermes(text)
        if self.format == ToolFormat.MISTRAL:
            at = text.find("[TOOL_CALLS]")
            got = _json_at(text, at + len("[TOOL_CALLS]")) if at >= 0 else None
            if got is None:
                return text, []
            items = got[0] if isinstance(got[0], list) else [got[0]]
            found = [c for c in (_call(i) for i in items) if c]
            return (text[:at].strip() or None, found) if found else (text, [])
        stripped = text.strip()
        if self.format == ToolFormat.LLAMA3:
            body = stripped.removeprefix("<|python_tag|>")
            got = _json_at(body, 0)
            one = _call(got[0], "parameters") if got and not body[got[1] :].strip() else None
            return (None, [one]) if one else (text, [])
        got = _json_at(stripped, 0)  # generic
        if got is None or not isinstance(got[0], dict) or stripped[got[1] :].strip():
            return _cut_response(stripped, text), []
        obj = got[0]
        if "tool_calls" in obj and isinstance(obj["tool_calls"], list):
            found = [c for c in (_call(i) for i in obj["tool_calls"]) if c]
            return (None, found) if found else (text, [])
        if "tool_call" in obj:
            one = _call(obj["tool_call"])
            return (None, [one]) if one else (text, [])
        if "response" in obj:
            answer = obj["response"]
            return answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False), []
        return text, []

    def splitter(self) -> ToolStream:
        """A :class:`ToolStream` for this plan's streamed output."""
        return ToolStream(self)


_RESPONSE_HEAD = re.compile(r'\{\s*"response"\s*:\s*"')


def _cut_response(stripped: str, text: str) -> str:
    """The text of a ``generic`` ``{"response": "...`` answer cut short (by ``max_tokens``), else ``text``."""
    head = _RESPONSE_HEAD.match(stripped)
    if head is None:
        return text
    body = stripped[head.end() :]
    for cut in range(min(len(body), 6) + 1):  # drop a half-written escape at the end
        try:
            value = json.loads('"' + body[: len(body) - cut] + '"')
        except ValueError:
            continue
        return value if isinstance(value, str) else text
    return text


def _response_so_far(held: str) -> str:
    """The text of a ``generic`` ``{"response": "...`` answer as far as it has arrived ("" for other
    JSON): up to the string's closing quote, less a half-written escape or surrogate pair."""
    stripped = held.lstrip()
    head = _RESPONSE_HEAD.match(stripped)
    if head is None:
        return ""
    body, i = stripped[head.end() :], 0
    while i < len(body):
        if body[i] == "\\":
            i += 2
        elif body[i] == '"':
            body = body[:i]
            break
        else:
            i += 1
    value = _cut_response(stripped[: head.end()] + body, "")
    return value[:-1] if value and "\ud800" <= value[-1] <= "\udbff" else value


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while (at := text.find("<tool_call>", pos)) >= 0:
        got = _json_at(text, at + len("<tool_call>"))
        one = _call(got[0]) if got else None
        if got is None or one is None:
            break
        content.append(text[pos:at])
        calls.append(one)
        end = got[1]
        close = text.find("</tool_call>", end)
        pos = close + len("</tool_call>") if close >= 0 and not text[end:close].strip() else end
    if not calls:
        return text, []
    content.append(text[pos:])
    rest = "".join(content).strip()
    return rest or None, calls


class ToolStream:
    """Splits streamed text into content to send now and text held back as a possible call.

    ``hermes``/``mistral``: text before the call marker streams (less a tail that could be the
    marker's start); from the marker on, everything is held.  ``llama3``: an answer that starts
    (after spaces) like a call is held whole.  ``generic``: the JSON is held, the text of a
    ``{"response": "..."}`` answer streams as it is decoded.  :meth:`finish` parses what was held
    (:meth:`ToolPlan.parse`) and returns the content not sent yet.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.holding = plan.format == ToolFormat.GENERIC
        self.marker = {ToolFormat.HERMES: "<tool_call>", ToolFormat.MISTRAL: "[TOOL_CALLS]"}.get(plan.format, "")
        self.started = False
        self.sent = ""  # the generic answer's text sent so far

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held) that can be sent as content now."""
        if self.holding:
            self.held += text
            if self.plan.format != ToolFormat.GENERIC:
                return ""
            value = _response_so_far(self.held)
            new, self.sent = value[len(self.sent) :], value
            return new
        buf = self.held + text
        if self.plan.format == ToolFormat.LLAMA3 and not self.started:
            lead = buf.lstrip()
            if not lead:
                self.held = buf
                return ""
            self.started = True
            if "<|python_tag|>".startswith(lead[:14]) or lead.startswith("{"):
                self.holding, self.held = True, buf
                return ""
        if not self.marker:
            self.held = ""
            return buf
        at = buf.find(self.marker)
        if at >= 0:
            self.holding, self.held = True, buf[at:]
            return buf[:at]
        keep = next(
            (k for k in range(min(len(self.marker) - 1, len(buf)), 0, -1) if self.marker.startswith(buf[-k:])), 0
        )
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of what was held, at the end of the answer."""
        held, self.held = self.held, ""
        if not self.holding:
            return held, []
        content, calls = self.plan.parse(held)
        content = content or ""
        if self.sent and content.startswith(self.sent):
            content = content[len(self.sent) :]
        return content, calls


class AnswerText:
    """A streamed chat answer's text as the client may see it: stop strings held back and cut
    (:class:`StopTextFilter`, as llama-server never sends them), then, with a ``plan``, tool calls
    held back and parsed (:class:`ToolStream`)."""

    def __init__(self, stops: list[str], plan: ToolPlan | None) -> None:
        self.stops = StopTextFilter(stops)
        self.split = plan.splitter() if plan is not None else None

    def feed(self, text: str) -> str:
        """The content that can be sent now, of ``text`` and what was held."""
        out = self.stops.feed(text)
        return self.split.feed(out) if self.split is not None else out

    def finish(self, stop_string: str = "") -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` at the end: the content not sent yet (cut before ``stop_string``, the
        stop string that ended the generation, if any) and the tool calls parsed from what was held."""
        rest = self.stops.finish(stop_string)
        if self.split is None:
            return rest, []
        rest = self.split.feed(rest)  # the tail first: it may complete a held call
        held, calls = self.split.finish()
        return rest + held, calls


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
