"""Tool-call formats without a server or a model: which format a chat template gets (Hermes
``<tool_call>``, Mistral ``[TOOL_CALLS]``, Llama 3 ``<|python_tag|>``, llama.cpp's generic JSON), parsing a whole
answer, splitting a streamed one into content and call deltas, the refusals of a plan, and the generic
format's messages.  The formats are llama.cpp's (``common/chat.cpp``); the deltas are what llama-server's
``server-task.cpp`` streams."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from orchestrator.generation.parsers.base import detect
from orchestrator.generation.pieces import CallDelta
from orchestrator.generation.tool_calls import parse_tools
from orchestrator.generation.tool_plan import ToolPlan, plan_of
from orchestrator.service_error import ServiceError
from tests.orchestrator.tool_call_cases import ADD, ASK, QWEN25, WEATHER


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
