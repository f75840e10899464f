"""Tool calls on ``/v1/chat/completions`` and the Responses API (``/v1/responses``), driven by the real
``openai`` SDK and LangChain's ``bind_tools`` against real servers on the default model.

The default model (SmolLM2-135M-Instruct) has a ChatML template that never reads ``tools``: it gets
llama.cpp's generic JSON tool format (tools described in a system message, the call enforced by a
grammar when ``tool_choice`` requires one).  The Hermes ``<tool_call>`` path runs on the same weights
with Qwen 2.5's tool-calling template written into a copy of the GGUF (gguf's
``gguf_new_metadata``), so the template's own ``tools`` rendering and the wrapped grammar are
exercised on a real engine.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.generation.parsers.base import detect
from orchestrator.generation.pieces import CallDelta
from orchestrator.generation.tool_calls import parse_tools
from orchestrator.generation.tool_plan import ToolPlan, plan_of
from orchestrator.service_error import ServiceError
from tests.conftest import ServerProc

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# Qwen2.5-Instruct's chat template (its tokenizer_config.json), the Hermes <tool_call> format
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


# ----------------------------------------------------------------------------- parsing (no server)


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (QWEN25, "hermes"),
        ("{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
        ("<|start_header_id|>ipython{{ tools }}", "llama3"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
        ("<tool_call>\n<function={{ tools }}<parameter=", "unknown"),
        ("{% if tools %}{{ tools }}{% endif %}", "unknown"),
    ],
)
def test_detect_format(template: str, fmt: str) -> None:
    assert detect(template) == fmt


@pytest.mark.parametrize(
    ("template", "text", "content", "calls"),
    [
        (
            QWEN25,
            'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            "Sure.",
            [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})],
        ),
        (QWEN25, "no call here", "no call here", []),
        (QWEN25, '<tool_call>{"name": "add", "argum', '<tool_call>{"name": "add", "argum', []),  # cut short: text
        ("[TOOL_CALLS]", 'x[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', "x", [("add", {"a": 1})]),
        (
            "<|start_header_id|>ipython",
            '<|python_tag|>{"name": "add", "parameters": {"a": 1}}',
            None,
            [("add", {"a": 1})],
        ),
        (
            "<|start_header_id|>ipython",
            '{"name": "add", "parameters": {}} and more',
            "and more",  # the call stands once read (it has streamed); text after it is content
            [("add", {})],
        ),
        ("{{ messages }}", '{"tool_call": {"name": "add", "arguments": {"a": 3}}}', None, [("add", {"a": 3})]),
        ("{{ messages }}", '{"tool_calls": [{"name": "add", "arguments": {}}]}', None, [("add", {})]),
        ("{{ messages }}", '{"response": "hello"}', "hello", []),
        ("{{ messages }}", '{"response": "cut \\u00e9 sho', "cut \u00e9 sho", []),  # max_tokens ended it
        ("{{ messages }}", '{"response": "cut \\u00', "cut ", []),
        ("{{ messages }}", "plain text", "plain text", []),
    ],
)
def test_parse_formats(template: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    plan = plan_of(template, [WEATHER, ADD], "auto", True)
    assert plan is not None
    got_content, got = plan.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and c.id != got[0].id for c in got[1:])


def _streamed(plan: ToolPlan, pieces: list[str]) -> tuple[list[Any], str, list[tuple[str, str, str]]]:
    """Feed ``pieces`` to a :class:`ToolStream`: everything it gave out, the content, and the calls
    ``(id, name, arguments)`` put together from the deltas as a client does."""
    split = plan.splitter()
    out = [p for piece in pieces for p in split.feed(piece)] + split.finish()
    calls: list[list[str]] = []
    for p in out:
        if isinstance(p, CallDelta):
            if p.name is not None:
                assert p.index == len(calls) and p.id and p.arguments == ""
                calls.append([p.id, p.name, ""])
            calls[p.index][2] += p.arguments
    return out, "".join(p for p in out if isinstance(p, str)), [(i, n, a) for i, n, a in calls]


STREAMED = [
    (
        QWEN25,
        'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, "x\\"}y"]}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo \\u00e9"}}</tool_call>',
        ["<tool_call>", "</tool_call>", '"name"'],
    ),
    (
        "[TOOL_CALLS]",
        'x[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
        ["[TOOL_CALLS]", "TOOL", '"name"'],
    ),
    (
        "<|start_header_id|>ipython",
        ' <|python_tag|>{"name": "add", "parameters": {"a": 1.5e3, "b": null} , "id": "x"}',
        ["{", "<|"],
    ),
    (
        "{{ messages }}",
        '{"tool_calls": [{"name": "add", "arguments": {"a": 3}}, {"name": "get_weather", "arguments": {"city": "Pa"}}]}',
        ["{", "tool"],
    ),
    ("{{ messages }}", '{"response": "Hello \\u00e9\\n\\ud83d\\ude00 <tool_call> !"}', ["{", "response"]),
]


@pytest.mark.parametrize(("template", "text", "leaks"), STREAMED)
def test_stream_split_at_every_boundary_matches_the_whole(template: str, text: str, leaks: list[str]) -> None:
    """Each format's answer streamed in two pieces split at every character, and one character at a
    time: the content is the whole answer's (no call text in it), each call's argument pieces
    concatenate to exactly the whole answer's ``arguments``, and the calls come in more than one piece."""
    plan = plan_of(template, [WEATHER, ADD], "auto", True)
    assert plan is not None
    whole_content, whole = plan.parse(text)
    expected = [(c.name, c.arguments) for c in whole]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(21)
    for _ in range(50):  # and as tokens of a few characters
        cuts = sorted(rng.sample(range(1, len(text)), 12))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        out, content, calls = _streamed(plan, pieces)
        assert (content.strip() or None if calls else content) == whole_content, pieces
        assert not any(leak in content for leak in leaks if leak not in (whole_content or "")), (pieces, content)
        assert [(n, a) for _, n, a in calls] == expected, pieces
    if expected:  # one character at a time: every call's arguments arrive in several pieces, before its end
        out, _, _ = _streamed(plan, list(text))
        for index, (_, arguments) in enumerate(expected):
            got = [p.arguments for p in out if isinstance(p, CallDelta) and p.index == index and p.name is None]
            assert len(got) > 1 and "".join(got) == arguments
    for _, arguments in expected:
        json.loads(arguments)


def test_stream_holds_back_what_may_be_a_call() -> None:
    """Content goes out as soon as it cannot be the start of a call; a call's header goes out once its
    name is read and its arguments have begun (llama-server's ``server-task.cpp`` holds it as long)."""
    plan = plan_of(QWEN25, [ADD], "auto", False)
    assert plan is not None
    split = plan.splitter()
    pieces = [
        "Let",
        " me <to",
        "ol_c",
        'all>\n{"name": "add", ',
        '"arguments": {"a": 1,',
        ' "b": 2}}',
        "\n</tool_call>",
    ]
    sent = [split.feed(p) for p in pieces]
    assert sent[:4] == [["Let"], [" me "], [], []]  # "<to" and the name wait
    (header, first), second = sent[4], sent[5]
    assert (header.index, header.name, header.arguments) == (0, "add", "") and header.id.startswith("call_")
    assert first == CallDelta(0, '{"a": 1,') and second == [CallDelta(0, ' "b": 2}')]
    assert sent[6] == [] and split.finish() == []
    plain = plan.splitter()
    assert plain.feed("a <t") + plain.feed("c>") + plain.finish() == ["a ", "<tc>"]
    cut = plan.splitter()  # cut short before the arguments: text after all
    assert cut.feed('<tool_call>{"name": "add", "argum') == [] and cut.finish() == ['<tool_call>{"name": "add", "argum']
    broken = plan.splitter()  # not JSON after the marker: text
    assert broken.feed("<tool_call> oops") + broken.finish() == ["<tool_call> oops"]


def test_generic_answer_streams_as_it_is_decoded() -> None:
    plan = plan_of("{{ messages }}", [ADD], "auto", False)
    assert plan is not None
    split = plan.splitter()
    pieces = ['{"res', 'ponse": "Hel', "lo \\", "u00e9\\n", "\\ud83d", "\\ude00", ' !"}']
    sent = [split.feed(p) for p in pieces]
    assert sent == [[], ["Hel"], ["lo "], ["\u00e9\n"], [], ["\U0001f600"], [" !"]]  # a lone surrogate waits
    assert split.finish() == []
    calls = plan.splitter()
    assert calls.feed('{"tool_call": {"name": "add", ') == []
    header, args = calls.feed('"arguments": {}}}')
    assert header.name == "add" and args == CallDelta(0, "{}") and calls.finish() == []


def test_plan_refusals() -> None:
    with pytest.raises(ServiceError, match="needs tools"):
        plan_of(QWEN25, None, "required", None)
    with pytest.raises(ServiceError, match="not in tools"):
        plan_of(QWEN25, [ADD], {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(ServiceError, match="cannot parse"):
        plan_of("{% if tools %}{{ tools }}{% endif %}", [ADD], "required", None)
    with pytest.raises(ServiceError, match="only type 'function'"):
        parse_tools([{"type": "web_search"}])
    for name in ('say"hi', "back\\slash", "new\nline"):  # a name the call grammar could not carry: named
        with pytest.raises(ServiceError, match=re.escape(repr(name))):
            parse_tools([{"type": "function", "function": {"name": name}}])
    assert parse_tools([{"type": "function", "function": {"name": "ns.get-weather_2"}}])[0].name == "ns.get-weather_2"
    with pytest.raises(ServiceError, match="tool_choice must be"):
        plan_of(QWEN25, [ADD], "sometimes", None)
    unknown = plan_of("{% if tools %}{{ tools }}{% endif %}", [ADD], "auto", None)
    assert unknown is not None and not unknown.active and unknown.grammar() is None  # auto: plain text


def test_generic_messages_describe_tools_and_history() -> None:
    plan = ToolPlan("{{ messages }}", parse_tools([WEATHER]), "required", False)
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]
    out = plan.messages(history)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert "get_weather" in out[0]["content"] and "Respond in JSON format" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert out[3]["role"] == "user" and json.loads(out[3]["content"])["tool_response"]["content"] == "sunny"
    assert plan.template_tools() is None
    gbnf, schema, triggers = plan.grammar() or ("", {}, ["x"])
    assert gbnf == "root ::= tc-call" and schema["required"] == ["tool_call"] and triggers == []


@pytest.mark.parametrize("template", [QWEN25, "[TOOL_CALLS]", "<|start_header_id|>ipython", "{{ messages }}"])
@pytest.mark.parametrize("choice", ["auto", "required", "none", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("parallel", [False, True])
def test_every_format_grammar_is_one_llama_cpp_takes(model, template: str, choice: Any, parallel: bool) -> None:  # type: ignore[no-untyped-def]
    """Each format's grammar (wrapper + the tools' schemas, lazy for ``auto``) parses in llama.cpp."""
    import llama_cpp

    from engine.grammar import gbnf_of, grammar_sampler
    from orchestrator.generation.parsers.base import CALL_RULE

    plan = plan_of(template, [WEATHER, ADD], choice, parallel)
    assert plan is not None
    got = plan.grammar()
    if got is None:
        assert choice == "none" and plan.format != "generic"
        return
    gbnf, schema, triggers = got
    assert bool(triggers) == (choice == "auto" and plan.format != "generic")
    sampler = grammar_sampler(model.vocab, gbnf_of(gbnf, json.dumps(schema), CALL_RULE), triggers)
    llama_cpp.llama_sampler_free(sampler)


def test_lazy_grammar_constrains_from_the_trigger_on(model) -> None:  # type: ignore[no-untyped-def]
    """``tool_choice: auto`` on a Hermes template: any text until ``<tool_call>``, then only the call."""
    import ctypes

    import llama_cpp

    from engine.grammar import gbnf_of, grammar_sampler
    from orchestrator.generation.parsers.base import CALL_RULE

    plan = plan_of(QWEN25, [ADD], "auto", False)
    assert plan is not None
    gbnf, schema, triggers = plan.grammar() or ("", {}, [])
    sampler = grammar_sampler(model.vocab, gbnf_of(gbnf, json.dumps(schema), CALL_RULE), triggers)

    def allowed(text: str) -> bool:
        tok = model.tokenize(text, False, False)[0]
        one = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(tok, 0.0, 0.0))
        arr = llama_cpp.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
        return one[0].logit != float("-inf")

    try:
        assert allowed("Paris") and allowed("<")  # not triggered: everything goes
        for tok in model.tokenize("Sure. <tool_call>", False, False):
            llama_cpp.llama_sampler_accept(sampler, tok)
        assert not allowed("Paris") and allowed("\n")  # triggered: the call's grammar
        for tok in model.tokenize('\n{"name": "', False, False):
            llama_cpp.llama_sampler_accept(sampler, tok)
        assert allowed("add") and not allowed("get")  # only the tools' names
    finally:
        llama_cpp.llama_sampler_free(sampler)


# ----------------------------------------------------------------------------- the default model (generic)


@pytest.fixture(scope="module")
def client(server: ServerProc):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def weather(city: str) -> str:
    """The tool the agent loops run."""
    return json.dumps({"city": city, "temp_c": 21, "sky": "sunny"})


def test_agent_loop_openai_sdk(client) -> None:  # type: ignore[no-untyped-def]
    """The model must call the tool; the client runs it and sends the result; the model answers in text,
    on the same slot (the conversation's KV cache continues)."""
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        user="tc-agent",
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str) and args["city"]
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": weather(args["city"])})
    second = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=10, temperature=0, user="tc-agent"
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # the first turn's cache


def test_streamed_tool_call_matches_the_whole_answer(client) -> None:  # type: ignore[no-untyped-def]
    """A required call streamed through the SDK: a first delta with the id, type and name, then the
    arguments in several pieces; the SDK's accumulated call parses to the whole answer's."""
    kw: dict[str, Any] = dict(
        model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=60, temperature=0, seed=7
    )
    whole = client.chat.completions.create(**kw, user="tc-s1").choices[0]
    chunks = list(client.chat.completions.create(**kw, user="tc-s2", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and all(d.index == 0 for d in deltas) and deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function.name == whole.message.tool_calls[0].function.name and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    pieces = [d.function.arguments for d in deltas[1:]]
    assert len(pieces) > 1 and all(pieces)  # streamed in pieces, not whole at the end
    assert json.loads("".join(pieces)) == json.loads(whole.message.tool_calls[0].function.arguments)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] and not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with client.chat.completions.stream(**kw, user="tc-s3") as stream:  # the SDK's own accumulation
        kinds = [ev.type for ev in stream]
        final = stream.get_final_completion().choices[0]
    assert kinds.count("tool_calls.function.arguments.delta") > 1
    (call,) = final.message.tool_calls
    assert call.function.name == whole.message.tool_calls[0].function.name
    assert json.loads(call.function.arguments) == json.loads(whole.message.tool_calls[0].function.arguments)
    assert call.function.arguments == "".join(pieces)  # the same pieces at temperature 0


def test_named_function_and_parallel_calls(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is 2 plus 3?"}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=True,
        max_tokens=60,
        temperature=0,
        user="tc-named",
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "add" for c in calls) and len({c.id for c in calls}) == len(calls)
    for c in calls:
        args = json.loads(c.function.arguments)
        assert isinstance(args["a"], int) and isinstance(args["b"], int)


def test_auto_answers_in_text_or_a_call(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[WEATHER],
        max_tokens=40,
        temperature=0,
        user="tc-auto",
    )
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert not choice.message.tool_calls and choice.message.content is not None
        if choice.finish_reason == "stop":  # a whole {"response": ...} answer is unwrapped
            assert not choice.message.content.lstrip().startswith('{"response"')


def test_generic_text_answer_streams_like_the_whole(client) -> None:  # type: ignore[no-untyped-def]
    """tool_choice none on a template without tools: the answer is {"response": ...} JSON under a grammar,
    returned and streamed as its text (here cut by max_tokens)."""
    kw: dict[str, Any] = dict(
        model="m", messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER], tool_choice="none",
        max_tokens=16, temperature=0,
    )  # fmt: skip
    whole = client.chat.completions.create(**kw, user="tc-txt1").choices[0]
    chunks = list(client.chat.completions.create(**kw, user="tc-txt2", stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.message.content and not whole.message.content.lstrip().startswith("{")
    assert text == whole.message.content and not whole.message.tool_calls
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 2  # streamed, not held to the end


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": [{"type": "retrieval"}]}, "only type 'function'"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "Cannot specify grammar",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [{"type": "function", "function": {"name": 'say"hi'}}]}, """tool 'say"hi': a function name"""),
    ],
)
def test_bad_tool_requests_are_400(server: ServerProc, body: dict[str, Any], needle: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "user": "tc-bad", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == "INVALID_REQUEST" and needle in r.json()["error"]["message"]
    assert httpx.get(server.url + "/api/v1/slots/tc-bad", timeout=30).status_code == 404  # no slot was made


def test_langchain_bind_tools(server: ServerProc) -> None:
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = lc.ChatOpenAI(
        base_url=server.url + "/v1", api_key="unused", model="m", temperature=0, max_tokens=48, max_retries=0
    )
    bound = llm.bind_tools([WEATHER], tool_choice="required")
    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]
    reply = bound.invoke(messages, user="tc-lc")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)
    messages += [
        reply,
        ToolMessage(weather(reply.tool_calls[0]["args"]["city"]), tool_call_id=reply.tool_calls[0]["id"]),
    ]
    final = llm.bind_tools([WEATHER], tool_choice="none").invoke(messages, user="tc-lc", max_tokens=10)
    assert isinstance(final.content, str) and final.content and not final.tool_calls
    chunks = list(bound.stream([HumanMessage("What is the weather in Paris?")], user="tc-lc2"))
    assert sum(1 for c in chunks if c.tool_call_chunks) > 2  # the header, then argument pieces
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c  # LangChain accumulates the tool_call_chunks into tool_calls
    assert whole.tool_calls == [{**reply.tool_calls[0], "id": whole.tool_calls[0]["id"]}]


# ----------------------------------------------------------------------------- the Responses API


FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_text_and_previous_response_id(client) -> None:  # type: ignore[no-untyped-def]
    first = client.responses.create(
        model="m", input="Name a color.", instructions="Answer briefly.", max_output_tokens=12, temperature=0
    )
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output[0].type == "message" and first.output_text and first.usage.input_tokens > 0
    second = client.responses.create(
        model="m",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And another one?"}]}],
        instructions="Answer briefly.",
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
    )
    # the same slot: everything of the first turn is already in its cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.previous_response_id == first.id and second.output_text


def test_responses_unknown_previous_id_is_404(server: ServerProc) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error_code"] == "NOT_FOUND"
    bad = httpx.post(server.url + "/v1/responses", json={"input": [{"type": "item_reference", "id": "x"}]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error_code"] == "INVALID_REQUEST"


def test_responses_stream_through_the_sdk(client) -> None:  # type: ignore[no-untyped-def]
    whole = client.responses.create(model="m", input="Say hi.", max_output_tokens=10, temperature=0, store=False)
    kinds: list[str] = []
    text = ""
    with client.responses.stream(
        model="m", input="Say hi.", max_output_tokens=10, temperature=0, store=False
    ) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert text == final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_responses_function_call_loop(client) -> None:  # type: ignore[no-untyped-def]
    events = list(
        client.responses.create(
            model="m",
            input="Weather in Rome?",
            tools=[FLAT_WEATHER],
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = events[-1].response
    (call,) = done.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)["city"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments  # streamed as the model wrote them
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    answer = client.responses.create(
        model="m",
        previous_response_id=done.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": weather("Rome")}],
        tools=[FLAT_WEATHER],
        tool_choice="none",
        max_output_tokens=10,
        temperature=0,
    )
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens > 0


def test_responses_forced_call_with_an_output_schema(client) -> None:  # type: ignore[no-untyped-def]
    """instructor's ``RESPONSES_TOOLS`` mode: a named function forced and ``text.format`` a JSON schema, which
    OpenAI accepts together; the answer is the call (the schema has no text to shape)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model="m",
        input="Weather in Rome?",
        tools=[FLAT_WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "Weather", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)["city"]


# ----------------------------------------------------------------------------- a Hermes template


@pytest.fixture(scope="module")
def hermes_gguf(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default GGUF with Qwen 2.5's tool-calling template as its ``tokenizer.chat_template``."""
    work = tmp_path_factory.mktemp("hermes")
    (work / "t.jinja").write_text(QWEN25)
    out = work / "smollm2-hermes.gguf"
    cmd = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(model_path), str(out)]
    subprocess.run([*cmd, "--chat-template-file", str(work / "t.jinja"), "--force"], check=True, capture_output=True)
    return out


def test_hermes_template_calls_and_history(
    hermes_gguf: Path, start_server: Callable[..., ServerProc], tmp_path: Path
) -> None:
    srv = start_server(
        "--model", str(hermes_gguf), "--parallel", "2", "--ctx-size", "2048", "--state-dir", str(tmp_path / "st")
    )
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    plain = c.chat.completions.create(model="m", messages=ASK, max_tokens=1, temperature=0, user="h0")
    first = c.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=60, temperature=0, user="h1"
    )
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 60  # the template rendered <tools>
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "add")
    json.loads(call.function.arguments)
    stream = list(
        c.chat.completions.create(
            model="m",
            messages=ASK,
            tools=[WEATHER, ADD],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
            user="h2",
            stream=True,
        )
    )
    streamed = [tc for ch in stream if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert (streamed[0].function.name, streamed[0].function.arguments) == (call.function.name, "")
    assert len(streamed) > 2 and "".join(d.function.arguments for d in streamed) == call.function.arguments
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": weather("Paris")},
    ]
    after = c.chat.completions.create(
        model="m", messages=history, tools=[WEATHER, ADD], max_tokens=8, temperature=0, user="h1"
    )
    assert (
        after.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    )  # the <tool_call> turn re-rendered as generated
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
