"""Tool calls with a template that renders ``tools``: the default model's weights with Qwen 2.5's
tool-calling template written into a copy of the GGUF (gguf's ``gguf_new_metadata``), so the template's
own ``tools`` rendering, the Hermes ``<tool_call>`` format and its wrapped grammar run on a real engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ServerProc, with_chat_template
from tests.orchestrator.tool_call_cases import ADD, ASK, QWEN25, WEATHER, weather

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def hermes_gguf(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default GGUF with Qwen 2.5's tool-calling template as its ``tokenizer.chat_template``."""
    return with_chat_template(model_path, QWEN25, tmp_path_factory.mktemp("hermes") / "smollm2-hermes.gguf")


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
