"""llama-server's extras on the OpenAI routes, against the real server: ``timings_per_token``,
``return_progress`` (``prompt_progress`` chunks) and ``verbose`` (``__verbose``), as llama-server sends
them (``tools/server/server-task.cpp``, ``to_json_oaicompat*``)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import ServerProc

SYSTEM = "You are a librarian called Book."
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the best book? " * 20}]


def chunks(server: ServerProc, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``data:`` JSON chunks of a streamed OpenAI answer, up to ``data: [DONE]``."""
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return out
                out.append(json.loads(line[6:]))
    raise AssertionError("no data: [DONE]")


def test_timings_per_token_on_chat_stream(server: ServerProc) -> None:
    body = {"messages": ASK, "max_tokens": 8, "temperature": 0, "user": "ext-timings"}
    got = chunks(
        server, "/v1/chat/completions", {**body, "timings_per_token": True, "stream_options": {"include_usage": True}}
    )
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" not in got[0]
    content = [c for c in got if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert all("timings" in c for c in content)
    counts = [c["timings"]["predicted_n"] for c in content]
    assert counts and counts == sorted(counts) and counts[0] >= 1
    last = got[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] == last["usage"]["completion_tokens"]
    t = last["timings"]
    assert t["prompt_n"] + t["cache_n"] == last["usage"]["prompt_tokens"]
    assert t["prompt_ms"] > 0 and t["prompt_per_second"] > 0 and t["predicted_ms"] > 0
    plain = chunks(server, "/v1/chat/completions", body)
    assert not any("timings" in c for c in plain)


def test_return_progress_on_chat_stream(server: ServerProc) -> None:
    body = {"messages": ASK, "max_tokens": 4, "temperature": 0, "user": "ext-progress", "return_progress": True}
    for turn in range(2):  # the second finds the prompt in the slot's cache
        got = chunks(server, "/v1/chat/completions", body)
        idx = [i for i, c in enumerate(got) if "prompt_progress" in c]
        progress = [got[i]["prompt_progress"] for i in idx]
        assert len(progress) >= 2
        first_token = next(i for i, c in enumerate(got) if c["choices"] and c["choices"][0]["delta"].get("content"))
        assert max(idx) < first_token
        assert all(got[i]["choices"][0]["delta"] == {"role": "assistant", "content": None} for i in idx)
        assert progress[0]["cache"] == progress[0]["processed"]
        assert all(p["total"] == progress[0]["total"] and p["cache"] == progress[0]["cache"] for p in progress)
        assert [p["processed"] for p in progress] == sorted({p["processed"] for p in progress})
        assert progress[-1]["processed"] == progress[-1]["total"] > 100
        assert (progress[0]["cache"] > 0) == (turn == 1)
    assert not any(
        "prompt_progress" in c for c in chunks(server, "/v1/chat/completions", {**body, "return_progress": False})
    )


def test_text_completion_stream_progress_and_timings(server: ServerProc) -> None:
    body = {
        "prompt": "Once upon a time " * 10,
        "max_tokens": 4,
        "temperature": 0,
        "timings_per_token": True,
        "return_progress": True,
    }
    got = chunks(server, "/v1/completions", body)
    progress = [c for c in got if "prompt_progress" in c]
    assert progress and all(c["choices"][0]["text"] == "" for c in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    assert all("timings" in c for c in got if "prompt_progress" not in c)
    assert got[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_verbose_adds_llama_server_answer(server: ServerProc) -> None:
    body = {"messages": ASK, "max_tokens": 3, "temperature": 0, "user": "ext-verbose"}
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "verbose": True}, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    v = answer["__verbose"]
    assert SYSTEM in v["prompt"] and v["stop"] is True
    assert v["content"] == answer["choices"][0]["message"]["content"]
    assert v["tokens_predicted"] == answer["usage"]["completion_tokens"] == len(v["tokens"])
    assert v["tokens_evaluated"] == answer["usage"]["prompt_tokens"] and v["timings"]["predicted_n"] == 3
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert "__verbose" not in plain
    got = chunks(server, "/v1/chat/completions", {**body, "verbose": True})
    marked = [c for c in got if "__verbose" in c]
    assert len(marked) == 1 and marked[0]["choices"][0]["finish_reason"] is not None
    assert marked[0]["__verbose"]["content"] == "" and SYSTEM in marked[0]["__verbose"]["prompt"]
    text = httpx.post(
        server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "verbose": True}, timeout=120
    )
    assert text.status_code == 200 and text.json()["__verbose"]["prompt"].endswith("Hello")


def test_responses_stream_with_llama_telemetry(server: ServerProc) -> None:
    """``/v1/responses`` streams take llama-server's ``return_progress`` and ``timings_per_token``: a
    ``response.in_progress`` event per prefill step, ``timings`` on the text deltas and the last event."""
    body = {"input": "What is the best book? " * 20, "max_output_tokens": 6, "temperature": 0, "stream": True}
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", server.url + "/v1/responses", json={**body, "return_progress": True, "timings_per_token": True},
        timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    done = [p["prompt_progress"]["processed"] for p in progress]
    assert done == sorted(done) and done[-1] == progress[-1]["prompt_progress"]["total"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("timings" in e for e in deltas)
    assert events[-1]["type"] == "response.completed" and events[-1]["timings"]["predicted_n"] >= 1
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
