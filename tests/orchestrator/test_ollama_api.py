"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``) on the real default model, through the real ``ollama`` Python client where it has a call
for it and over HTTP where the test reads what the client hides (NDJSON lines, headers, error bodies).
The request parsing that needs no model (``keep_alive``, ``format``, messages) is checked first."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from orchestrator.api.ollama.protocol import Message, ToolCall, ToolCallFunction
from orchestrator.api.ollama.serving import chat_messages, keep_alive_s, schema_of
from orchestrator.web.errors import ApiError
from tests.conftest import ServerProc
from tests.orchestrator.tool_call_cases import WEATHER
from tests.waiting import wait_until

GREEDY = {"temperature": 0, "seed": 7}
HI = [{"role": "user", "content": "Tell me about the sea in one sentence."}]


# ------------------------------------------------------------------------------ parsing (no server)


def test_keep_alive_is_read_as_ollama_reads_a_duration() -> None:
    assert keep_alive_s(None) is None
    assert [keep_alive_s(v) for v in (0, "0", 30, 2.5, "5m", "1h30m", "1.5s", "250ms")] == [
        0.0, 0.0, 30.0, 2.5, 300.0, 5400.0, 1.5, 0.25,
    ]  # fmt: skip
    assert keep_alive_s(-1) == float("inf") and keep_alive_s("-5m") == float("inf")
    for bad in ("5", "five minutes", "5 m", "", "m"):
        with pytest.raises(ApiError) as err:
            keep_alive_s(bad)
        assert err.value.code == "INVALID_REQUEST"


def test_format_becomes_the_json_schema_of_the_grammar() -> None:
    assert schema_of(None) == "" and schema_of("") == ""
    assert json.loads(schema_of("json")) == {"type": "object"}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    assert json.loads(schema_of(schema)) == schema
    with pytest.raises(ApiError):
        schema_of("xml")


def test_messages_reach_the_template_in_openai_shape() -> None:
    call = ToolCall(function=ToolCallFunction(name="get_weather", arguments={"city": "Paris"}))
    msgs = [
        Message(role="user", content="Weather?"),
        Message(role="assistant", content="", tool_calls=[call], thinking="Look it up."),
        Message(role="tool", content="sunny", tool_name="get_weather"),
    ]
    out = chat_messages(msgs)
    assert out[0] == {"role": "user", "content": "Weather?"}
    (made,) = out[1]["tool_calls"]
    assert made["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert out[1]["reasoning_content"] == "Look it up."
    assert out[2] == {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": made["id"]}
    with pytest.raises(ApiError):
        chat_messages([Message(role="user", content="What is this?", images=["iVBORw0KGgo="])])


# ------------------------------------------------------------------------------ over HTTP


def _post(server: ServerProc, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=600, **kw)


def _lines(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines() if line]


def _model(server: ServerProc) -> str:
    return str(httpx.get(server.url + "/api/tags", timeout=60).json()["models"][0]["model"])


def _slots(server: ServerProc) -> dict[str, dict[str, Any]]:
    return {str(s["id"]): s for s in httpx.get(server.url + "/slots", timeout=60).json()}


@pytest.fixture(scope="module")
def client(server: ServerProc):  # type: ignore[no-untyped-def]
    ollama = pytest.importorskip("ollama")  # the test extras install it
    return ollama.Client(host=server.url, timeout=600)


def test_version_list_show_ps(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    version = httpx.get(server.url + "/api/version", timeout=60).json()
    assert version == {"version": "0.9.0"}
    listed = client.list().models
    assert len(listed) == 1
    m = listed[0]
    model = httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]
    assert m.model == f"{model['id']}:latest" and m.size == model["meta"]["size"] and m.digest
    assert m.details.format == "gguf" and m.details.family == "llama" and m.details.parameter_size == "135M"
    assert m.details.quantization_level == "Q4_1"
    shown = client.show(m.model)
    assert shown.modelinfo["llama.block_count"] == 30 and shown.modelinfo["llama.attention.head_count"] == 9
    assert "<|im_start|>" in (shown.template or "") and shown.capabilities == ["completion", "tools"]
    assert "num_ctx" in (shown.parameters or "")
    assert client.show(model["id"]).details.family == "llama"  # the tag is optional
    (running,) = client.ps().models
    assert running.model == m.model and running.context_length == 2048 and running.size_vram == 0


def test_chat_whole_and_streamed_agree(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    model = _model(server)
    options = {**GREEDY, "num_predict": 12}
    whole = client.chat(model=model, messages=HI, options=options)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 12 and whole.prompt_eval_count > 10 and whole.total_duration > 0
    assert whole.message.content
    parts = list(client.chat(model=model, messages=HI, options=options, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].message.content == "" and parts[-1].eval_count == 12 and parts[-1].done_reason == "length"
    # a stop string is cut from the answer and ends it
    word = whole.message.content.split()[2]
    stopped = client.chat(model=model, messages=HI, options={**options, "stop": [word]})
    assert stopped.done_reason == "stop" and word not in stopped.message.content


def test_generate_context_round_trip(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    """The answer's ``context`` is the prompt's tokens and the answer's; sent back, the next prompt continues
    them: its own ``context`` starts with them, and the slot reuses their KV cache."""
    model = _model(server)
    options = {**GREEDY, "num_predict": 8}
    first = client.generate(model=model, prompt="Name a colour.", options=options)
    context = list(first.context)
    rendered = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    ids = _post(server, "/tokenize", {"content": rendered, "parse_special": True}).json()["tokens"]
    assert context[-first.eval_count - len(ids) : -first.eval_count] == ids  # after the template's system turn
    answer = _post(server, "/detokenize", {"tokens": context[-first.eval_count :]}).json()["content"]
    assert answer == first.response
    body = {"model": model, "prompt": "And another one?", "context": context, "options": options, "stream": False}
    r = _post(server, "/api/generate", body)
    second = r.json()
    assert second["context"][: len(context)] == context and len(second["context"]) > len(context)
    slot = _slots(server)[r.headers["x-slot-id"]]
    assert slot["n_prompt_tokens_cache"] >= len(context) - 1  # the whole first turn came from the cache
    # streamed: the same answer, the context on the last line only
    lines = _lines(_post(server, "/api/generate", {**body, "stream": True}))
    assert "".join(x["response"] for x in lines) == second["response"]
    assert lines[-1]["context"] == second["context"] and all("context" not in x for x in lines[:-1])
    # raw mode: the prompt as it is, and no context (as Ollama)
    raw = client.generate(model=model, prompt=rendered, raw=True, options=options)
    assert raw.response and not raw.context


def test_prompt_longer_than_a_batch(server: ServerProc) -> None:
    prompt = " ".join(f"item{i}" for i in range(400)) + "\nWhich item came first?"
    body = {"model": _model(server), "prompt": prompt, "options": {**GREEDY, "num_predict": 4}, "stream": False}
    out = _post(server, "/api/generate", body).json()
    assert out["prompt_eval_count"] > 512 and out["eval_count"] == 4 and out["done"]


def test_several_conversations_at_once(server: ServerProc) -> None:
    model = _model(server)

    def chat(i: int) -> dict[str, Any]:
        msgs = [{"role": "user", "content": f"Count from {i} to {i + 5}."}]
        body = {"model": model, "messages": msgs, "options": {**GREEDY, "num_predict": 6}, "stream": False}
        return _post(server, "/api/chat", body, headers={"X-Session-Id": f"ollama-user-{i}"}).json()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(chat, range(4)))
    assert all(a["done"] and a["eval_count"] == 6 and a["message"]["content"] for a in answers), answers
    alone = chat(2)
    assert alone["message"]["content"] == answers[2]["message"]["content"]  # greedy: the same, alone or not


def test_format_json_schema(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    msgs = [{"role": "user", "content": "Ollama is 22 years old. Describe Ollama as JSON."}]
    out = client.chat(model=_model(server), messages=msgs, format=schema, options={**GREEDY, "num_predict": 40})
    parsed = json.loads(out.message.content)
    assert set(parsed) == {"name", "age"} and isinstance(parsed["age"], int) and isinstance(parsed["name"], str)
    anything = client.generate(
        model=_model(server), prompt='Reply with the JSON object {"name": "Bob"}.', format="json",
        options={**GREEDY, "num_predict": 60},
    )  # fmt: skip
    assert anything.done_reason == "stop", anything.response
    assert isinstance(json.loads(anything.response), dict), anything.response


def test_tools(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    """The model calls the tool (the whole call in one line, arguments an object); the call and its result
    (a ``tool`` message with ``tool_name``) sent back continue the same conversation: its slot holds them,
    after the first turn's cached prompt."""
    model = _model(server)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    options = {**GREEDY, "num_predict": 40}
    first = client.chat(model=model, messages=msgs, tools=[WEATHER], options=options)
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    body = {"model": model, "messages": msgs, "tools": [WEATHER], "options": options}
    lines = _lines(_post(server, "/api/chat", body))
    (streamed,) = [x for x in lines if x["message"].get("tool_calls")]
    assert streamed["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": dict(call.function.arguments), "index": 0,
    }  # fmt: skip
    assert lines[-1]["done"] and "tool_calls" not in lines[-1]["message"]
    msgs += [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "content": "Sunny, 24 degrees", "tool_name": "get_weather"},
    ]
    r = _post(server, "/api/chat", {**body, "messages": msgs, "options": {**GREEDY, "num_predict": 4}, "stream": False})
    second = r.json()
    assert r.status_code == 200 and second["done"], second
    assert second["prompt_eval_count"] > first.prompt_eval_count
    slot = r.headers["x-slot-id"]
    assert _slots(server)[slot]["n_prompt_tokens_cache"] >= first.prompt_eval_count - 1  # the first turn's prompt
    tokens = _post(server, f"/slots/{slot}?action=tokens", {}).json()["tokens"]
    held = _post(server, "/detokenize", {"tokens": tokens}).json()["content"]
    assert '"get_weather"' in held and "Sunny, 24 degrees" in held  # the call and its result, in the prompt


def test_embed(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    model = _model(server)
    texts = ["The sky is blue.", "Grass is green."]
    out = client.embed(model=model, input=texts)
    vectors = np.array(out.embeddings)
    assert vectors.shape == (2, 576) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert out.prompt_eval_count > 6
    openai = _post(server, "/v1/embeddings", {"input": texts}).json()["data"]
    assert np.allclose(vectors, [d["embedding"] for d in openai], atol=1e-6)  # one embeddings path
    short = np.array(client.embed(model=model, input=texts[0], dimensions=64).embeddings)
    assert short.shape == (1, 64) and np.isclose(np.linalg.norm(short), 1.0, atol=1e-5)
    old = np.array(client.embeddings(model=model, prompt=texts[0]).embedding)  # the older route: not normalized
    assert np.allclose(old / np.linalg.norm(old), vectors[0], atol=1e-5)


def test_keep_alive_parks_the_slot(server: ServerProc) -> None:
    """``keep_alive`` 0 parks the conversation's slot with the answer; a duration, once idle that long."""
    body = {"model": _model(server), "messages": HI, "options": {**GREEDY, "num_predict": 3}, "stream": False}
    r = _post(server, "/api/chat", {**body, "keep_alive": 0}, headers={"X-Slot-Id": "ollama-park"})
    assert r.status_code == 200 and r.json()["done"]
    slot = _slots(server)["ollama-park"]
    assert slot["place"] == "parked" and slot["n_tokens"] > 0
    kept = _post(server, "/api/chat", {**body, "keep_alive": "5m"}, headers={"X-Slot-Id": "ollama-park"})
    assert kept.status_code == 200 and _slots(server)["ollama-park"]["place"] == "resident"
    assert kept.json()["prompt_eval_count"] > 0
    short = _post(server, "/api/chat", {**body, "keep_alive": "1s"}, headers={"X-Slot-Id": "ollama-park"})
    assert short.status_code == 200
    wait_until(lambda: _slots(server)["ollama-park"]["place"] == "parked", "the slot parked after 1 s idle")
    loaded = _post(server, "/api/generate", {"model": body["model"]}).json()  # Ollama's "load the model"
    assert loaded["done"] and loaded["done_reason"] == "load" and loaded["response"] == ""


def test_bad_bodies_are_4xx_with_an_error_code_and_change_nothing(server: ServerProc, client) -> None:  # type: ignore[no-untyped-def]
    ollama = pytest.importorskip("ollama")
    model = _model(server)
    headers = {"X-Slot-Id": "ollama-bad"}
    good = {"model": model, "messages": HI, "options": {**GREEDY, "num_predict": 3}, "stream": False}
    first = _post(server, "/api/chat", good, headers=headers).json()
    before = _slots(server)["ollama-bad"]
    chats: list[tuple[dict[str, Any], int, str]] = [
        ({**good, "model": "llama3.2"}, 404, "NOT_FOUND"),
        ({k: v for k, v in good.items() if k != "model"}, 400, "INVALID_REQUEST"),
        ({**good, "messages": "hello"}, 400, "INVALID_REQUEST"),
        ({**good, "messages": [{"content": "no role"}]}, 400, "INVALID_REQUEST"),
        ({**good, "options": {"temperature": "hot"}}, 400, "INVALID_REQUEST"),
        ({**good, "options": {"top_p": 2}}, 400, "INVALID_REQUEST"),
        ({**good, "options": {"num_predict": 100_000}}, 400, "CONTEXT_OVERFLOW"),
        ({**good, "format": "xml"}, 400, "INVALID_REQUEST"),
        ({**good, "format": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, 400, "INVALID_GRAMMAR"),
        ({**good, "keep_alive": "five minutes"}, 400, "INVALID_REQUEST"),
        ({**good, "think": True}, 400, "INVALID_REQUEST"),
        ({**good, "think": "extreme"}, 400, "INVALID_REQUEST"),
        ({**good, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "INVALID_REQUEST"),
        ({**good, "messages": [{"role": "user", "content": "What?", "images": ["iVBORw0KGgo="]}]}, 400, "INVALID_REQUEST"),
    ]  # fmt: skip
    generates: list[tuple[dict[str, Any], int, str]] = [
        ({"model": model, "prompt": "Hi", "context": [10**9]}, 400, "INVALID_TOKEN"),
        ({"model": model, "prompt": "Hi", "context": [-1]}, 400, "INVALID_TOKEN"),
        ({"model": model, "prompt": "Hi", "raw": True, "system": "Be brief."}, 400, "INVALID_REQUEST"),
        ({"model": model, "prompt": "def f(", "suffix": "return x"}, 400, "INVALID_REQUEST"),
        ({"model": model, "prompt": "Hi", "template": "{{ .Prompt }}"}, 400, "INVALID_REQUEST"),
        ({"model": model, "prompt": "Hi", "options": {"stop": "x"}}, 400, "INVALID_REQUEST"),
    ]
    others: list[tuple[str, dict[str, Any], int, str]] = [
        ("/api/embed", {"model": model, "input": ["a", ""]}, 400, "INVALID_REQUEST"),
        ("/api/embed", {"model": model, "input": "a", "dimensions": 100_000}, 400, "INVALID_REQUEST"),
        ("/api/embed", {"model": "nomic-embed-text", "input": "a"}, 404, "NOT_FOUND"),
        ("/api/show", {"model": "llama3.2"}, 404, "NOT_FOUND"),
        ("/api/show", {}, 400, "INVALID_REQUEST"),
    ]
    cases = [("/api/chat", *c) for c in chats] + [("/api/generate", *c) for c in generates] + others
    for path, body, status, code in cases:
        for stream in (False, True) if path in ("/api/chat", "/api/generate") else (None,):
            sent = body if stream is None else {**body, "stream": stream}
            r = _post(server, path, sent, headers=headers)
            assert r.status_code == status, (path, sent, r.text)
            err = r.json()
            assert err["error_code"] == code and isinstance(err["error"], str) and err["error"], (path, sent, err)
    not_json = httpx.post(server.url + "/api/chat", content=b"{not json", timeout=60, headers=headers)
    assert not_json.status_code == 400 and not_json.json()["error_code"] == "INVALID_REQUEST"
    with pytest.raises(ollama.ResponseError) as raised:  # what the client makes of Ollama's error body
        client.chat(model="llama3.2", messages=HI)
    assert raised.value.status_code == 404 and raised.value.error == "model 'llama3.2' not found"
    after = _slots(server)["ollama-bad"]
    assert {k: after.get(k) for k in ("n_tokens", "place")} == {k: before.get(k) for k in ("n_tokens", "place")}
    again = _post(server, "/api/chat", good, headers=headers).json()
    assert again["message"] == first["message"]  # greedy on the unchanged slot: the same answer
    assert _slots(server)["ollama-bad"]["n_prompt_tokens_cache"] >= first["prompt_eval_count"] - 1  # from its cache
