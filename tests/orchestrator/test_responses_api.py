"""The Responses API (``/v1/responses``) driven by the real ``openai`` SDK against the shared server on the
default model: text turns chained by ``previous_response_id``, its event stream, and a function-call loop
(https://platform.openai.com/docs/api-reference/responses)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import ServerProc
from tests.orchestrator.tool_call_cases import WEATHER, weather

pytest.importorskip("openai")


FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_text_and_previous_response_id(openai_client) -> None:  # type: ignore[no-untyped-def]
    first = openai_client.responses.create(
        model="m", input="Name a color.", instructions="Answer briefly.", max_output_tokens=12, temperature=0
    )
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output[0].type == "message" and first.output_text and first.usage.input_tokens > 0
    second = openai_client.responses.create(
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


def test_responses_stream_through_the_sdk(openai_client) -> None:  # type: ignore[no-untyped-def]
    whole = openai_client.responses.create(model="m", input="Say hi.", max_output_tokens=10, temperature=0, store=False)
    kinds: list[str] = []
    text = ""
    with openai_client.responses.stream(
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


def test_responses_function_call_loop(openai_client) -> None:  # type: ignore[no-untyped-def]
    events = list(
        openai_client.responses.create(
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
    answer = openai_client.responses.create(
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


def test_responses_forced_call_with_an_output_schema(openai_client) -> None:  # type: ignore[no-untyped-def]
    """instructor's ``RESPONSES_TOOLS`` mode: a named function forced and ``text.format`` a JSON schema, which
    OpenAI accepts together; the answer is the call (the schema has no text to shape)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    r = openai_client.responses.create(
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
