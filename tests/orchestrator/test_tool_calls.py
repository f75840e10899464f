"""Tool calls on ``/v1/chat/completions`` driven by the real ``openai`` SDK and LangChain's ``bind_tools``
against the shared server on the default model.

The default model (SmolLM2-135M-Instruct) has a ChatML template that never reads ``tools``: it gets
llama.cpp's generic JSON tool format (tools described in a system message, the call enforced by a
grammar when ``tool_choice`` requires one).  The formats themselves are tested without a server in
``test_tool_call_formats.py``, a template that renders ``tools`` in ``test_tool_calls_hermes.py``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProc
from tests.orchestrator.tool_call_cases import ADD, ASK, WEATHER, weather

pytest.importorskip("openai")


def test_agent_loop_openai_sdk(openai_client) -> None:  # type: ignore[no-untyped-def]
    """The model must call the tool; the client runs it and sends the result; the model answers in text,
    on the same slot (the conversation's KV cache continues)."""
    messages: list[Any] = list(ASK)
    first = openai_client.chat.completions.create(
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
    second = openai_client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=10, temperature=0, user="tc-agent"
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # the first turn's cache


def test_streamed_tool_call_matches_the_whole_answer(openai_client) -> None:  # type: ignore[no-untyped-def]
    """A required call streamed through the SDK: a first delta with the id, type and name, then the
    arguments in several pieces; the SDK's accumulated call parses to the whole answer's."""
    kw: dict[str, Any] = dict(
        model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=60, temperature=0, seed=7
    )
    whole = openai_client.chat.completions.create(**kw, user="tc-s1").choices[0]
    chunks = list(openai_client.chat.completions.create(**kw, user="tc-s2", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and all(d.index == 0 for d in deltas) and deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function.name == whole.message.tool_calls[0].function.name and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    pieces = [d.function.arguments for d in deltas[1:]]
    assert len(pieces) > 1 and all(pieces)  # streamed in pieces, not whole at the end
    assert json.loads("".join(pieces)) == json.loads(whole.message.tool_calls[0].function.arguments)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] and not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with openai_client.chat.completions.stream(**kw, user="tc-s3") as stream:  # the SDK's own accumulation
        kinds = [ev.type for ev in stream]
        final = stream.get_final_completion().choices[0]
    assert kinds.count("tool_calls.function.arguments.delta") > 1
    (call,) = final.message.tool_calls
    assert call.function.name == whole.message.tool_calls[0].function.name
    assert json.loads(call.function.arguments) == json.loads(whole.message.tool_calls[0].function.arguments)
    assert call.function.arguments == "".join(pieces)  # the same pieces at temperature 0


def test_named_function_and_parallel_calls(openai_client) -> None:  # type: ignore[no-untyped-def]
    r = openai_client.chat.completions.create(
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


def test_auto_answers_in_text_or_a_call(openai_client) -> None:  # type: ignore[no-untyped-def]
    r = openai_client.chat.completions.create(
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


def test_generic_text_answer_streams_like_the_whole(openai_client) -> None:  # type: ignore[no-untyped-def]
    """tool_choice none on a template without tools: the answer is {"response": ...} JSON under a grammar,
    returned and streamed as its text (here cut by max_tokens)."""
    kw: dict[str, Any] = dict(
        model="m", messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER], tool_choice="none",
        max_tokens=16, temperature=0,
    )  # fmt: skip
    whole = openai_client.chat.completions.create(**kw, user="tc-txt1").choices[0]
    chunks = list(openai_client.chat.completions.create(**kw, user="tc-txt2", stream=True))
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
