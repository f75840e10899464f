"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) on the real default model,
over HTTP and through the real ``anthropic`` SDK: answers, the streamed events, a tool_use -> tool_result
loop, token counts, and refusals.  The conversion itself (Anthropic request -> chat messages, as
llama-server's ``server_chat_convert_anthropic_to_oai``) is checked without a server first."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from orchestrator.api.anthropic.protocol import MessagesRequest
from orchestrator.api.anthropic.serving import chat_messages, chat_tool_choice, chat_tools, normalize_billing_header
from orchestrator.generation.chat_template import ChatTemplate
from orchestrator.generation.tool_plan import plan_of
from orchestrator.web.errors import ApiError
from tests.conftest import ServerProc

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
STORY = "Write a long story about a dragon who learns to bake bread, with many chapters."


def _request(body: dict[str, Any]) -> MessagesRequest:
    return msgspec.convert(body, MessagesRequest)


# ------------------------------------------------------------------------------ conversion (no server)


def test_messages_become_chat_messages_as_llama_server_makes_them() -> None:
    req = _request(
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=a5145;"},
                {"type": "text", "text": "Be brief."},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " it?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Look it up.", "signature": ""},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Results:"},
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                        {"type": "tool_result", "tool_use_id": "t9", "is_error": True, "content": "no such call"},
                    ],
                },
            ],
        }
    )
    assert chat_messages(req) == [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1; cch=fffff;Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " it?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
            "reasoning_content": "Look it up.",
        },
        {"role": "user", "content": [{"type": "text", "text": "Results:"}]},  # the text first, then the results
        {"role": "tool", "tool_call_id": "t1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "t9", "content": "no such call"},
    ]


# llama.cpp's copy of Qwen3's template, in the pinned llama.cpp's sources beside the repository (as tests/compat uses)
LLAMA_CPP = Path(__file__).resolve().parents[3] / "llama" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
QWEN3 = LLAMA_CPP / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja"


@pytest.mark.skipif(not QWEN3.exists(), reason="the pinned llama.cpp's sources are not beside the repository")
def test_thinking_history_reaches_a_template_that_reads_it() -> None:
    """llama.cpp's test_anthropic_thinking_history_in_count_tokens / _in_template need --chat-template-file,
    which slotserve does not offer: the same check here, with the same template (Qwen3's, which renders an
    assistant turn's ``reasoning_content`` in ``<think>``), through this module's conversion and tool plan."""
    source = QWEN3.read_text()
    thought = "I should check the project structure first."
    call = {"type": "tool_use", "id": "call_1", "name": "list_files", "input": {"path": "."}}
    tool = {"name": "list_files", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}

    def prompt(blocks: list[dict[str, Any]]) -> str:
        req = _request(
            {
                "tools": [tool],
                "messages": [
                    {"role": "user", "content": "Fix the bug"},
                    {"role": "assistant", "content": blocks},
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "main.py"}],
                    },
                ],
            }
        )
        plan = plan_of(source, chat_tools(req.tools), None, None)
        assert plan is not None
        return ChatTemplate(source, "", "<|im_end|>").render(
            plan.messages(chat_messages(req)), tools=plan.template_tools()
        )

    without, with_thinking = prompt([call]), prompt([{"type": "thinking", "thinking": thought}, call])
    assert f"<think>\n{thought}\n</think>" in with_thinking and thought not in without
    assert '"name": "list_files", "arguments": {"path": "."}' in with_thinking  # the call, in the template's form


def test_tools_and_tool_choice() -> None:
    assert chat_tools([_request({"messages": [], "tools": [WEATHER]}).tools[0]]) == [  # type: ignore[index]
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    choices = [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "get_weather"}]
    assert [chat_tool_choice(_request({"messages": [], "tool_choice": c}).tool_choice) for c in choices] == [
        "auto",
        "required",
        "none",
        {"type": "function", "function": {"name": "get_weather"}},
    ]
    with pytest.raises(ApiError):
        chat_tool_choice(_request({"messages": [], "tool_choice": {"type": "tool"}}).tool_choice)
    with pytest.raises(ApiError):
        chat_tools(_request({"messages": [], "tools": [{"type": "web_search_20250305", "name": "web"}]}).tools)


def test_billing_header_stamp() -> None:
    head = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code"
    assert normalize_billing_header(head) == head.replace("a5145", "fffff")
    assert normalize_billing_header("You are helpful. cch=a5145;") == "You are helpful. cch=a5145;"
    assert normalize_billing_header("x-anthropic-billing-header: cch=a51") == "x-anthropic-billing-header: cch=a51"


# ----------------------------------------------------------------------------------- the real server


def _post(server: ServerProc, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=600, **kw)


def _events(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of every server-sent event of ``r``."""
    out = []
    for frame in r.text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_message_answer(server: ServerProc) -> None:
    body = {"model": "m", "max_tokens": 12, "temperature": 0, "system": "Be brief.", "messages": ASK}
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert [b["type"] for b in m["content"]] == ["text"] and m["content"][0]["text"]
    assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
    usage = m["usage"]
    assert usage["output_tokens"] == 12 and usage["input_tokens"] + usage["cache_read_input_tokens"] > 10
    assert "timings" not in m and r.headers["x-slot-id"] == str(m["slot_id"])
    # the same prompt counted without generating
    n = _post(server, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert n.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}
    # a stop sequence ends it: cut from the text, named in the answer
    first_word = m["content"][0]["text"].split()[1]
    stopped = _post(server, "/v1/messages", {**body, "stop_sequences": [first_word]}).json()
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == first_word
    assert first_word not in stopped["content"][0]["text"]


def test_stream_events_in_order(server: ServerProc) -> None:
    body = {"model": "m", "max_tokens": 10, "temperature": 0, "messages": [{"role": "user", "content": "Say hello"}]}
    whole = _post(server, "/v1/messages", {**body, "slot_id": "an-whole"}).json()
    r = _post(server, "/v1/messages", {**body, "stream": True, "slot_id": "an-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert all(name == data["type"] for name, data in events)  # the event name is the data's type
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == sum(
        whole["usage"][k] for k in ("input_tokens", "cache_read_input_tokens")
    )
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["index"] == 0)
    assert text == whole["content"][0]["text"]
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1]["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert events[-2][1]["usage"] == {"output_tokens": whole["usage"]["output_tokens"]}


def test_streamed_tool_use_matches_the_whole(server: ServerProc) -> None:
    body = {
        "model": "m",
        "max_tokens": 60,
        "temperature": 0,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": ASK,
    }
    whole = _post(server, "/v1/messages", body).json()
    assert whole["stop_reason"] == "tool_use"
    (call,) = whole["content"]
    assert call["type"] == "tool_use" and call["name"] == "get_weather" and isinstance(call["input"]["city"], str)
    events = _events(_post(server, "/v1/messages", {**body, "stream": True}))
    (start,) = [d for n, d in events if n == "content_block_start"]
    assert start["index"] == 0 and start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["name"] == "get_weather" and start["content_block"]["input"] == {}
    parts = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert parts and all(p["type"] == "input_json_delta" for p in parts)
    assert json.loads("".join(p["partial_json"] for p in parts)) == call["input"]
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_refusals_are_400_and_leave_the_slot(server: ServerProc) -> None:
    good = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": ASK, "slot_id": "an-bad"}
    first = _post(server, "/v1/messages", good).json()
    prompt = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    bad: list[dict[str, Any]] = [
        {"max_tokens": 5},  # no messages
        {"messages": [{"role": "system", "content": "Hi"}]},  # Anthropic's roles are user and assistant
        {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
        {"messages": [{"role": "user", "content": [image]}]},
        {"messages": ASK, "tool_choice": {"type": "tool"}, "tools": [WEATHER]},
        {"messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
        {"messages": ASK, "tool_choice": {"type": "any"}},  # nothing to call
        {"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"messages": ASK, "top_p": 2},
        {"messages": ASK, "max_tokens": 100_000},
    ]
    for body in bad:
        r = _post(server, "/v1/messages", {**body, "slot_id": "an-bad"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["code"] == 400, err
        assert err["error"]["type"] in ("invalid_request_error", "exceed_context_size_error") and err["error_code"]
    image_error = _post(server, "/v1/messages", {"messages": [{"role": "user", "content": [image]}]}).json()
    assert "image input is not supported" in image_error["error"]["message"]
    assert _post(server, "/v1/messages/count_tokens", {"model": "m"}).status_code == 400
    again = _post(server, "/v1/messages", good).json()
    assert again["usage"]["cache_read_input_tokens"] >= prompt - 1  # the slot's cache is as it was


def test_empty_messages_are_400_as_anthropic(server: ServerProc) -> None:
    """Anthropic requires at least one message (llama-server answers 200 here: its
    test_anthropic_empty_messages, see docs/compat.md); no slot is made."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = _post(server, path, {"model": "m", "max_tokens": 3, "messages": [], "slot_id": "an-empty"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error_code"] == "INVALID_REQUEST" and "at least one message" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/api/v1/slots/an-empty", timeout=30).status_code == 404


# ------------------------------------------------------------------------------------ the Anthropic SDK


@pytest.fixture(scope="module")
def client(server: ServerProc):  # type: ignore[no-untyped-def]
    anthropic = pytest.importorskip("anthropic")  # the test extras install it; the tests above need no SDK
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def test_tool_loop_through_the_sdk(client) -> None:  # type: ignore[no-untyped-def]
    """The model must call the tool; the client runs it and sends a tool_result; the model answers in
    text on the same slot, reusing the first turn's cache."""
    greedy = {"temperature": 0, "slot_id": "an-agent"}
    messages: list[Any] = list(ASK)
    first = client.messages.create(
        model="m", max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"}, messages=messages, extra_body=greedy
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str) and call.input["city"]
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    result = json.dumps({"city": call.input["city"], "temp_c": 21, "sky": "sunny"})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]})
    second = client.messages.create(
        model="m", max_tokens=10, tools=[WEATHER], tool_choice={"type": "none"}, messages=messages, extra_body=greedy
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt  # the first turn's cache


def test_sdk_stream_and_count(client) -> None:  # type: ignore[no-untyped-def]
    kw: dict[str, Any] = dict(model="m", max_tokens=8, messages=[{"role": "user", "content": "Say hello"}])
    with client.messages.stream(**kw, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens > 0
    assert final.stop_reason in ("end_turn", "max_tokens")
    count = client.messages.count_tokens(model="m", messages=kw["messages"])
    assert count.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens
    with pytest.raises(pytest.importorskip("anthropic").BadRequestError) as e:
        client.messages.create(model="m", max_tokens=5, messages=kw["messages"], extra_body={"top_p": 2})
    assert e.value.status_code == 400


def test_worker_death_mid_stream_ends_with_an_error_event(start_server: Callable[..., ServerProc]) -> None:
    """The engine worker dies after ``message_start``: the stream ends with Anthropic's ``error`` event
    (the error body, ``error_code`` beside it), and the server answers again once its new worker is up."""
    srv = start_server("--parallel", "1", "--ctx-size", "1024")
    body = {"model": "m", "max_tokens": 600, "stream": True, "messages": [{"role": "user", "content": STORY}]}
    frames: list[str] = []
    with httpx.stream("POST", srv.url + "/v1/messages", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            frames.append(line)
            if line == "event: message_start":
                os.kill(srv.worker_pid(), signal.SIGKILL)
    names = [f.removeprefix("event: ") for f in frames if f.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    err = json.loads(frames[frames.index("event: error") + 1].removeprefix("data: "))
    assert err["type"] == "error" and err["error"]["code"] >= 500 and err["error"]["message"] and err["error_code"]
    deadline = time.monotonic() + 300
    while httpx.get(srv.url + "/health", timeout=30).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    again = _post(srv, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": ASK})
    assert again.status_code == 200 and again.json()["type"] == "message"
