"""``n`` > 1 on ``/v1/chat/completions`` and ``/v1/completions``: forks of one prefilled prompt,
driven by the real ``openai`` SDK (issue 21, item 2)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServerProc

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def client(server: ServerProc):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_choices_equal_the_single_answer(client, server: ServerProc) -> None:  # type: ignore[no-untyped-def]
    one = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0, user="n-chat")
    two = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0, user="n-chat", n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content == one.choices[0].message.content for c in two.choices)
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.usage.prompt_tokens_details.cached_tokens == one.usage.prompt_tokens  # the slot held the prompt
    # the slot keeps the prompt (prefilled once); the forks are gone
    tokens = httpx.post(server.url + "/slots/n-chat?action=tokens", timeout=30).json()["tokens"]
    assert len(tokens) == one.usage.prompt_tokens


def test_sampled_choices_streamed_with_their_index(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=12, temperature=1.5, n=2, stream=True, user="n-text"
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] and texts[1]
    chat = client.chat.completions.create(model="m", messages=ASK, max_tokens=6, n=2, stream=True, user="n-chat2")
    roles, content = set(), {0: "", 1: ""}
    for chunk in chat:
        c = chunk.choices[0]
        if c.delta.role:
            roles.add(c.index)
        content[c.index] += c.delta.content or ""
    assert roles == {0, 1} and content[0] and content[1]


def test_more_choices_than_spare_sequences(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="Hi", max_tokens=2, n=3)
    assert "--spare" in e.value.message and e.value.body["type"] == "invalid_request_error"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_streamed_choices_parse_their_tool_calls(client) -> None:  # type: ignore[no-untyped-def]
    """``n`` = 2 with a required tool, streamed: each choice's call comes in pieces under its own choice
    ``index`` (no call text in ``content``), and equals the non-streamed choices' calls."""
    kw = dict(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
        n=2,
    )
    whole = client.chat.completions.create(**kw, user="n-tools")
    args = {c.index: c.message.tool_calls[0].function.arguments for c in whole.choices}
    calls: dict[int, list[str]] = {0: [], 1: []}
    content = ""
    finish = {}
    for chunk in client.chat.completions.create(**kw, user="n-tools-s", stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls[choice.index] += [tc.function.arguments or "" for tc in choice.delta.tool_calls or []]
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert not content and finish == {0: "tool_calls", 1: "tool_calls"}
    assert {i: "".join(p) for i, p in calls.items()} == args and all(len(p) > 2 for p in calls.values())
