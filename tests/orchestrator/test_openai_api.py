"""The OpenAI-compatible API, driven by the real ``openai`` Python SDK against the real server."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProc
from tests.waiting import wait_until

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(server: ServerProc):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client) -> None:  # type: ignore[no-untyped-def]
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].object == "model" and models.data[0].id


def test_chat_non_streaming_logprobs_usage(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(
        model="any", messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, user="oa-chat-1"
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert 0 < len(content) <= 6 and r.usage.completion_tokens >= len(content)
    assert "".join(c.token for c in content).strip().startswith(choice.message.content.strip()[:3])
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
        assert c.top_logprobs[0].token == c.token  # greedy: the sampled token is the best one
    assert r.usage.prompt_tokens > 10 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # a fresh slot


def test_chat_streaming_matches_and_reports_usage(client) -> None:  # type: ignore[no-untyped-def]
    whole = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0, user="oa-s1")
    stream = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=8, temperature=0, user="oa-s1",
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_two_turn_chat_reuses_the_cache(client) -> None:  # type: ignore[no-untyped-def]
    msgs = [{"role": "user", "content": "Name a color."}]
    one = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0, user="oa-2turn")
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": one.choices[0].message.content},
             {"role": "user", "content": "Name another one."}]  # fmt: skip
    two = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0, user="oa-2turn")
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens, (cached, one.usage.prompt_tokens)  # turn 1's prompt came from the cache
    assert cached < two.usage.prompt_tokens


def test_slot_id_header_names_the_slot(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    c2 = client.with_options(default_headers={"X-Slot-Id": "oa-header"})
    c2.chat.completions.create(model="m", messages=ASK, max_tokens=2, temperature=0)
    slots = {s["id"]: s for s in httpx.get(server.url + "/slots").json()}
    assert slots["oa-header"]["n_tokens"] > 10


def test_completions_legacy_logprobs_and_stop(client) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"slot_id": "oa-cmpl"})  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.object == "text_completion" and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text
    assert " 5" in r.choices[0].text
    stopped = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"],
                                        extra_body={"slot_id": "oa-cmpl"})  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text
    assert stopped.choices[0].text == r.choices[0].text.split(" 7")[0]


def _settled(server: ServerProc) -> None:
    """Wait until every slot's state is saved (no write-behind pending), so the engine's idle-slot
    moves at the next job start do not depend on the write-behind's timing."""
    wait_until(
        lambda: not any(s.get("dirty") for s in httpx.get(server.url + "/slots", timeout=10).json()),
        "every slot saved",
    )


def test_completion_stream_seeded_sampling_repeats(client, server: ServerProc) -> None:  # type: ignore[no-untyped-def]
    def run(slot: str) -> str:
        _settled(server)
        s = client.completions.create(model="m", prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                      seed=1234, stream=True, extra_body={"slot_id": slot})  # fmt: skip
        return "".join(c.choices[0].text for c in s if c.choices)

    # Same slot, same seed, same cache layout: the same text.  (Which KV cells a token lands in
    # changes the order of llama.cpp's vectorised sums, so bitwise-equal logits need the same layout.)
    assert run("oa-seed") == run("oa-seed") != ""


def test_attention_extension(server: ServerProc) -> None:
    body = {"messages": ASK, "max_tokens": 3, "temperature": 0, "slot_id": "oa-att",
            "attention": {"format": "aggregated"}}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    atts = r["choices"][0]["attention"]
    assert len(atts) >= 1
    n_prompt = r["usage"]["prompt_tokens"]
    for k, a in enumerate(atts):
        row = np.frombuffer(base64.b64decode(a["data"]), dtype=np.float32)
        assert a["format"] == "aggregated" and a["shape"] == [n_prompt + k] == [row.size]
        assert abs(row.sum() - 1) < 1e-3


def test_errors_have_openai_shape(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, n=0)
    assert e.value.status_code == 400 and "n=0" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=100_000)
    assert e.value.body["type"] == "exceed_context_size_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=ASK, top_logprobs=3)  # without logprobs


def test_raw_error_body_and_unprefixed_paths(server: ServerProc) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": "nope"}, timeout=30)
    body = r.json()
    assert r.status_code == 400 and set(body["error"]) >= {"message", "type", "code"}
    assert body["error_code"] == "INVALID_REQUEST"
    assert httpx.get(server.url + "/models", timeout=30).json()["object"] == "list"
    ok = httpx.post(server.url + "/chat/completions", json={"messages": ASK, "max_tokens": 1}, timeout=120)
    assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"


def test_completions_several_prompts_one_choice_each(client, server: ServerProc) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's legacy ``prompt`` as a list of strings or of token lists: one choice per prompt, ``index`` its
    place, each the text the prompt gets alone; ``usage`` sums them; streamed, chunks carry their index."""
    prompts = ["1, 2, 3, 4,", "The capital of France is"]
    greedy = {"model": "m", "max_tokens": 6, "temperature": 0}
    alone = [client.completions.create(**greedy, prompt=p).choices[0].text for p in prompts]
    both = client.completions.create(**greedy, prompt=prompts)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == alone
    ids = [httpx.post(server.url + "/tokenize", json={"content": p, "add_special": True}).json()["tokens"]
           for p in prompts]  # fmt: skip
    by_ids = client.completions.create(**greedy, prompt=ids)
    assert [c.text for c in by_ids.choices] == alone
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    assert by_ids.usage.completion_tokens == both.usage.completion_tokens >= 2
    chunks = list(client.completions.create(**greedy, prompt=prompts, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    for k, text in enumerate(alone):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == k]
        assert "".join(c.text for c in mine) == text and mine[-1].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == both.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize(
    ("prompt", "extra", "code"),
    [
        ([], {}, "INVALID_REQUEST"),
        (["Hi", [1, 99_999_999]], {}, "INVALID_TOKEN"),
        (["Hi", "there"], {"n": 2}, "INVALID_REQUEST"),
        (["Hi", {"nope": 1}], {}, "INVALID_REQUEST"),
    ],
)
def test_several_prompts_bad_inputs_are_400(server: ServerProc, prompt: object, extra: dict, code: str) -> None:  # type: ignore[type-arg]
    slot = "oa-several-bad"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "slot_id": slot, **extra},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == code and r.json()["error"]["message"]
    assert httpx.get(server.url + f"/api/v1/slots/{slot}", timeout=30).status_code == 404  # no slot was made


def test_chat_logprobs_without_top_logprobs_gives_llama_servers_20(client) -> None:  # type: ignore[no-untyped-def]
    """llama-server's chat parsing sets ``n_probs`` to ``top_logprobs`` or 20 when ``logprobs`` is true."""
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 20 for c in content)
    assert all(c.top_logprobs[0].token == c.token for c in content)  # greedy: the best one was sampled
    none = client.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=0)  # fmt: skip
    assert all(c.top_logprobs == [] for c in none.choices[0].logprobs.content)
    assert all(c.logprob is not None and c.logprob <= 0 for c in none.choices[0].logprobs.content)  # computed


def test_completions_logprobs_zero_gives_each_tokens_own(client) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's legacy ``logprobs: 0``: each token's own logprob and no alternatives (the worker computes the
    logprobs a request asks for, and only those); without ``logprobs``, none."""
    r = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) > 0
    assert all(x is not None and x <= 0 for x in lp.token_logprobs) and all(not t for t in lp.top_logprobs)
    plain = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == r.choices[0].text
