"""llama-server's details on slotserve (issue 21, item 3): ``/slots`` as llama-server lists its
slots, ``/apply-template``, ``/chat/completions/input_tokens``, ``response_fields``, several
prompts in one ``/completion`` (streamed too), ``{"prompt_string"}``, ``system_fingerprint``, ``--alias``/``--tags``
in ``/v1/models``, ``--seed``, the first streamed chat chunk, the overflow message, CORS preflight,
unknown routes and two assistant messages at the end; llama-server's ``llamacpp:*`` metrics and its
capitalisation of the CORS and ``Process-Start-Time-Unix`` header names."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProc
from tests.orchestrator.client import post_json
from tests.orchestrator.tool_call_cases import WEATHER

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("details")
    s = ServerProc(["--parallel", "2", "--ctx-size", "512", "--threads", "2", "--seed", "42", "--alias",
                    "tiny,code, fim", "--tags", "chat,small", "--state-dir", str(work / "state")], work)  # fmt: skip
    s.start()
    yield s
    s.stop()


def post(srv: ServerProc, path: str, body: object, status: int = 200) -> Any:
    return post_json(srv.url, path, body, status, timeout=120)


def test_slots_lists_numbered_slots_then_named(srv: ServerProc) -> None:
    fresh = httpx.get(srv.url + "/slots", timeout=30).json()
    assert [s["id"] for s in fresh[:2]] == [0, 1] and all(s["n_ctx"] == 512 for s in fresh[:2])
    assert all(not s["is_processing"] and "params" not in s for s in fresh if s["place"] == "empty")
    post(srv, "/completion", {"prompt": "Hi", "n_predict": 2, "id_slot": "alice"})
    listing = httpx.get(srv.url + "/slots", timeout=30).json()
    assert [s["id"] for s in listing[:2]] == [0, 1] and "named" not in listing[0]
    alice = next(s for s in listing if s["id"] == "alice")
    assert alice["named"] is True and alice["params"]["n_predict"] == 2
    post(srv, "/slots/alice?action=erase", {})
    after = httpx.get(srv.url + "/slots", timeout=30).json()
    assert [s["id"] for s in after[:2]] == [0, 1] and all(s["id"] != "alice" for s in after)


def test_apply_template_and_input_tokens(srv: ServerProc) -> None:
    prompt = post(srv, "/apply-template", {"messages": MESSAGES})["prompt"]
    assert "Name a colour." in prompt and prompt.rstrip().endswith("assistant")
    ids = post(srv, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        assert post(srv, path, {"messages": MESSAGES, "max_tokens": 3}) == {"input_tokens": len(ids)}
    prefilled = post(srv, "/apply-template", {"messages": [*MESSAGES, {"role": "assistant", "content": "Blu"}]})
    assert prefilled["prompt"] == prompt + "Blu"  # a last assistant message is continued (llama-server's prefill)
    two = [*MESSAGES, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    err = post(srv, "/v1/chat/completions", {"messages": two}, 400)
    assert "Cannot have 2 or more assistant messages" in err["error"]["message"]
    assert err["error_code"] == "INVALID_REQUEST"


TOOL_TURN = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
]  # fmt: skip


@pytest.mark.parametrize("parallel", [False, True])
def test_apply_template_and_input_tokens_render_tools_as_the_chat(srv: ServerProc, parallel: bool) -> None:
    """One body with a tool, a tool call and its result: ``/apply-template``'s text is the prompt the chat
    path renders (its ``__verbose`` prompt) and ``input_tokens`` its ``prompt_tokens``; the tool's result
    carries the tool's name, looked up from the assistant's call."""
    body = {"messages": TOOL_TURN, "tools": [WEATHER], "parallel_tool_calls": parallel}
    text = post(srv, "/apply-template", body)["prompt"]
    assert "You can call any of the following tools" in text and '"get_weather"' in text
    assert '"tool": "get_weather"' in text and '"tool": null' not in text and "sunny, 21 C" in text
    chat = post(srv, "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0, "verbose": True})
    assert chat["__verbose"]["prompt"] == text
    assert post(srv, "/chat/completions/input_tokens", body) == {"input_tokens": chat["usage"]["prompt_tokens"]}
    ids = post(srv, "/tokenize", {"content": text, "add_special": True})["tokens"]
    assert len(ids) == chat["usage"]["prompt_tokens"] > 200
    named = [*TOOL_TURN[:2], {**TOOL_TURN[2], "name": "get_weather"}]  # the name as a client may send it
    assert post(srv, "/apply-template", {**body, "messages": named})["prompt"] == text
    bad = post(srv, "/apply-template", {**body, "tool_choice": "sometimes"}, 400)
    assert bad["error_code"] == "INVALID_REQUEST" and "tool_choice must be" in bad["error"]["message"]


def test_completion_prompts_fields_and_seed(srv: ServerProc) -> None:
    text = "The sky is"
    ids = post(srv, "/tokenize", {"content": text, "add_special": True})["tokens"]
    base = {"n_predict": 4, "temperature": 1.0, "cache_prompt": False}  # sampled: --seed 42 makes it repeatable
    one = post(srv, "/completion", {**base, "prompt": text})
    assert post(srv, "/completion", {**base, "prompt": text})["content"] == one["content"]
    assert one["generation_settings"]["seed"] == 42
    both = post(srv, "/completion", {**base, "prompt": [ids, {"prompt_string": text}, text]})
    assert [r["index"] for r in both] == [0, 1, 2] and {r["content"] for r in both} == {one["content"]}
    assert post(srv, "/completion", {**base, "prompt": {"prompt_string": text}})["content"] == one["content"]
    mm = post(srv, "/completion", {**base, "prompt": {"prompt_string": text, "multimodal_data": ["AAAA"]}}, 400)
    assert "Multimodal data provided" in mm["error"]["message"] and mm["error_code"] == "INVALID_REQUEST"
    fields = ["content", "generation_settings/n_predict", "timings/nope"]
    picked = post(srv, "/completion", {**base, "prompt": text, "response_fields": fields})
    assert picked == {"content": one["content"], "generation_settings/n_predict": 4}
    assert httpx.get(srv.url + "/props", timeout=30).json()["default_generation_settings"]["params"]["seed"] == 42
    # ignore_eos bans the end-of-generation tokens, reported as llama-server's -inf (null) biases
    banned = post(srv, "/completion", {**base, "prompt": text, "ignore_eos": True})["generation_settings"]
    assert banned["logit_bias"] and all(b["bias"] is None for b in banned["logit_bias"])
    assert post(srv, "/completion", {**base, "prompt": text})["generation_settings"]["logit_bias"] == []


def _sse(srv: ServerProc, path: str, body: object, stop_after: int | None = None) -> list[dict]:  # type: ignore[type-arg]
    """The ``data:`` events of a streamed answer (the first ``stop_after`` only: the client then leaves)."""
    got: list[dict] = []  # type: ignore[type-arg]
    with httpx.stream("POST", srv.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":  # OpenAI's streams end so
                got.append(json.loads(line[6:]))
                if stop_after is not None and len(got) >= stop_after:
                    break
    return got


def test_completion_streams_several_prompts(srv: ServerProc) -> None:
    """llama-server's ``/completion`` with a list of prompts and ``stream``: the prompts run at once on
    their slots, their chunks interleaved, each with its ``index``; each prompt's text is its
    non-streamed answer's, and each ends with one ``stop: true`` chunk (stop type, timings)."""
    prompts = ["The sky is", "Once upon a time, a"]
    base = {"n_predict": 12, "temperature": 0, "cache_prompt": False}
    whole = post(srv, "/completion", {**base, "prompt": prompts})
    chunks = _sse(srv, "/completion", {**base, "prompt": prompts, "stream": True})
    assert chunks and {c["index"] for c in chunks} == {0, 1}
    for i, answer in enumerate(whole):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["content"] for c in mine) == answer["content"]
        assert [c["stop"] for c in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1]["stop_type"] == answer["stop_type"] and mine[-1]["timings"]["predicted_n"] == 12
        assert mine[-1]["tokens_predicted"] == answer["tokens_predicted"]
    order = [c["index"] for c in chunks]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # interleaved: 1 starts before 0 ends
    ids = post(srv, "/tokenize", {"content": prompts[0], "add_special": True})["tokens"]
    three = _sse(srv, "/completion", {**base, "n_predict": 2, "prompt": [ids, prompts[1], prompts[0]], "stream": True})
    assert sorted(c["index"] for c in three if c["stop"]) == [0, 1, 2]  # more prompts than slots: they wait
    by = {i: "".join(c["content"] for c in three if c["index"] == i) for i in (0, 2)}
    assert by[0] == by[2]


def test_several_streamed_prompts_end_when_the_client_leaves(srv: ServerProc) -> None:
    body = {"n_predict": 400, "temperature": 1.0, "ignore_eos": True, "prompt": ["Tell a story.", "Count: 1, 2,"]}
    got = _sse(srv, "/completion", {**body, "stream": True}, stop_after=6)
    assert len(got) == 6 and all(not c["stop"] for c in got)
    deadline = time.monotonic() + 30
    while any(s.get("is_processing") for s in httpx.get(srv.url + "/slots", timeout=30).json()):
        assert time.monotonic() < deadline, "the generations went on after the client left"
        time.sleep(0.2)
    assert post(srv, "/completion", {"prompt": "Hi", "n_predict": 2})["stop"] is True  # the slots serve again


def test_models_fingerprint_and_first_chunk(srv: ServerProc) -> None:
    model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
    assert model["id"] == "code" and set(model["aliases"]) == {"tiny", "code", "fim"}
    assert set(model["tags"]) == {"chat", "small"}
    body = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(c["model"] == "code" and c["system_fingerprint"].startswith("b") for c in chunks)
    done = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert done["system_fingerprint"] == chunks[0]["system_fingerprint"] and done["model"] == "code"


def test_error_texts_cors_and_unknown_routes(srv: ServerProc) -> None:
    err = post(srv, "/completion", {"prompt": "word " * 600, "n_predict": 4}, 400)
    assert "exceeds the available context size" in err["error"]["message"]
    assert err["error"]["type"] == "exceed_context_size_error" and err["error_code"] == "CONTEXT_OVERFLOW"
    pre = httpx.options(srv.url + "/completions", headers={"Origin": "http://web.example", "Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "Authorization"}, timeout=30)  # fmt: skip
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://web.example"
    assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert pre.headers["access-control-allow-credentials"] == "true"
    for path in ("/no/such/route", "/v1/nothing"):
        r = httpx.get(srv.url + path, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404 and r.json()["error_code"] == "NOT_FOUND"
    own = httpx.get(srv.url + "/api/v1/nothing", timeout=30)
    assert own.status_code == 404 and own.json()["error_code"] == "NOT_FOUND"


def raw_head(srv: ServerProc, request: bytes) -> bytes:
    """The response's status line and headers as the server wrote them (names not lowered by a client)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            assert chunk, head
            head += chunk
    return head.split(b"\r\n\r\n")[0]


def test_header_names_have_llama_server_capitalisation(srv: ServerProc) -> None:
    head = raw_head(srv, b"OPTIONS /completions HTTP/1.1\r\nHost: x\r\nOrigin: web.mydomain.fr\r\n"
                         b"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: Authorization\r\n"
                         b"Connection: close\r\n\r\n")  # fmt: skip
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    for line in (b"Access-Control-Allow-Origin: web.mydomain.fr", b"Access-Control-Allow-Credentials: true",
                 b"Access-Control-Allow-Methods: GET, POST, DELETE, OPTIONS"):  # fmt: skip
        assert line in lines, head
    # the requested headers are named (llama-server answers "*", which browsers do not apply to
    # Authorization nor to requests with credentials: Fetch standard, "CORS-preflight fetch")
    allowed = next(line for line in lines if line.startswith(b"Access-Control-Allow-Headers: "))
    assert b"Authorization" in allowed
    head = raw_head(srv, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    start = [line for line in head.split(b"\r\n") if line.startswith(b"Process-Start-Time-Unix: ")]
    assert len(start) == 1 and int(start[0].split(b": ")[1]) > 1_700_000_000, head
    assert b"content-type: text/plain" in head  # the others as uvicorn writes them


def llama_metrics(srv: ServerProc) -> dict[str, tuple[str, float]]:
    """``llamacpp:*`` samples of ``/metrics``: name -> (its ``# TYPE``, value)."""
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    types = dict(line.split(" ")[2:4] for line in text.splitlines() if line.startswith("# TYPE llamacpp:"))
    helps = {line.split(" ")[2] for line in text.splitlines() if line.startswith("# HELP llamacpp:")}
    values = dict(line.split(" ") for line in text.splitlines() if line.startswith("llamacpp:"))
    assert set(values) == set(types) == helps
    return {name: (types[name], float(v)) for name, v in values.items()}


def test_llama_server_metrics_count_completions(srv: ServerProc) -> None:
    before = llama_metrics(srv)
    assert "slotserve_tokens_generated_total" in httpx.get(srv.url + "/metrics", timeout=30).text  # ours stay
    timings = [post(srv, "/completion", {"prompt": "the quick brown fox", "n_predict": n, "ignore_eos": True})["timings"]
               for n in (1, 6, 6)]  # fmt: skip
    after = llama_metrics(srv)
    counters = ["prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
                "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "spec_decode_num_drafts_total"]  # fmt: skip
    gauges = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
              "n_busy_slots_per_decode"]  # fmt: skip
    assert all(after[f"llamacpp:{n}"][0] == "counter" for n in counters)
    assert all(after[f"llamacpp:{n}"][0] == "gauge" for n in gauges)

    def delta(name: str) -> float:
        return after[f"llamacpp:{name}"][1] - before[f"llamacpp:{name}"][1]

    assert delta("prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert delta("prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings) > 0
    assert delta("tokens_predicted_total") == sum(t["predicted_n"] for t in timings) == 13
    assert delta("prompt_seconds_total") == pytest.approx(sum(t["prompt_ms"] for t in timings) / 1000)
    assert delta("n_decode_total") >= 3 + 5 + 5  # a prefill step each, then a step per token after the first
    assert after["llamacpp:requests_processing"][1] == 0 and after["llamacpp:n_tokens_max"][1] >= 6
    assert after["llamacpp:predicted_tokens_seconds"][1] > 0  # since the previous scrape
    # llama-server's rates are over decode steps: the first token comes from the prompt's logits
    assert timings[0]["predicted_n"] == 1 and timings[0]["predicted_per_second"] == 0.0
    assert timings[1]["predicted_per_second"] == pytest.approx(1e3 / timings[1]["predicted_ms"] * 5)


def _check_post_sampling(entries: list[dict], n_probs: int) -> None:  # type: ignore[type-arg]
    """llama.cpp's ``test_n_probs_post_sampling`` assertions on ``completion_probabilities`` entries."""
    for tok in entries:
        assert "logprob" not in tok and "top_logprobs" not in tok
        assert tok["id"] > 0 and isinstance(tok["token"], str) and isinstance(tok["bytes"], list)
        assert 0.0 < tok["prob"] <= 1.0
        for alt in tok["top_probs"]:
            assert set(alt) == {"id", "token", "bytes", "prob"} and 0.0 < alt["prob"] <= 1.0  # never a 0
        assert [a["prob"] for a in tok["top_probs"]] == sorted((a["prob"] for a in tok["top_probs"]), reverse=True)
        if len(tok["top_probs"]) < n_probs:  # fewer only when they are every token the chain left
            assert sum(a["prob"] for a in tok["top_probs"]) == pytest.approx(1.0)
        mine = [a["prob"] for a in tok["top_probs"] if a["id"] == tok["id"]]
        assert mine == [] or mine[0] == pytest.approx(tok["prob"])


def test_completion_post_sampling_probs(srv: ServerProc) -> None:
    """llama-server's ``post_sampling_probs`` (llama.cpp ``tools/server/tests/unit/test_completion.py``
    ``test_n_probs_post_sampling``): ``prob`` and ``top_probs`` after the sampler chain, streamed and not;
    greedy leaves the one token at 1."""
    body = {"prompt": "Today was the day. Today I would finally become a", "n_probs": 10, "temperature": 1.0,
            "n_predict": 5, "post_sampling_probs": True, "ignore_eos": True}  # fmt: skip  # 5 tokens on any CPU
    res = post(srv, "/completion", body)
    probs = res["completion_probabilities"]
    assert len(probs) == 5 and len(probs[0]["top_probs"]) == 10  # a vague prompt: 10 alternatives at first
    _check_post_sampling(probs, 10)
    assert res["generation_settings"]["post_sampling_probs"] is True
    chunks = _sse(srv, "/completion", {**body, "stream": True})
    streamed = [e for c in chunks for e in c.get("completion_probabilities", [])]
    assert len(streamed) == 5 and "completion_probabilities" not in chunks[-1]  # the last chunk: stop, no tokens
    _check_post_sampling(streamed, 10)
    greedy = post(srv, "/completion", {**body, "temperature": 0})["completion_probabilities"]
    for t in greedy:
        assert t["prob"] == 1.0 and t["top_probs"] == [{"id": t["id"], "token": t["token"], "bytes": t["bytes"],
                                                         "prob": 1.0}]  # fmt: skip
    plain = post(srv, "/completion", {**body, "post_sampling_probs": False})["completion_probabilities"]
    assert all("prob" not in t and t["logprob"] <= 0 and len(t["top_logprobs"]) == 10 for t in plain)


def test_chat_post_sampling_probs(srv: ServerProc) -> None:
    """llama-server takes ``post_sampling_probs`` on ``/v1/chat/completions`` too: ``logprobs.content`` entries
    are its ``probs_vector_to_json`` ones (``id``, ``token``, ``bytes``, ``prob``, ``top_probs``), streamed and not."""
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 1.0, "logprobs": True, "top_logprobs": 5,
            "post_sampling_probs": True, "ignore_eos": True}  # fmt: skip  # 4 tokens whatever the sampler draws
    content = post(srv, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(t["top_probs"] for t in content)
    _check_post_sampling(content, 5)
    chunks = _sse(srv, "/v1/chat/completions", {**body, "stream": True})
    streamed = [e for c in chunks for ch in c.get("choices", []) for e in (ch.get("logprobs") or {}).get("content", [])]
    assert len(streamed) == 4
    _check_post_sampling(streamed, 5)
