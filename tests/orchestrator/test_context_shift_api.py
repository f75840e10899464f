"""``--context-shift`` through the APIs (llama-server's flag; docs/api.md, "Context shift"), on a real
server with a 128-token window: llama-server's ``/completion`` generates past the window and reports
``truncated``, the native API marks the first attention row after each shift with ``context_shift`` and
every row covers what the slot holds, the slot keeps ``n_keep`` prompt tokens, a preview of the shifted
slot runs, and a prompt that fills the window is still refused with llama-server's message."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import post_json, tokenize

WINDOW = 128


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("ctxshift")
    s = ServerProc(["--context-shift", "--ctx-size", str(WINDOW), "--parallel", "1", "--spare", "2", "--threads", "2",
                    "--state-dir", str(work / "state")], work)  # fmt: skip
    s.start()
    yield s
    s.stop()


def post(srv: ServerProc, path: str, body: object, status: int = 200) -> Any:
    return post_json(srv.url, path, body, status, timeout=300)


def test_completion_generates_past_the_window(srv: ServerProc) -> None:
    model = httpx.get(srv.url + "/api/v1/model", timeout=30).json()
    assert model["engine"]["context_shift"] is True
    body = {"prompt": CHAT.format("Count from one to two hundred."), "n_predict": 200, "temperature": 0,
            "ignore_eos": True, "id_slot": "long"}  # fmt: skip
    res = post(srv, "/completion", body)
    assert res["tokens_predicted"] == res["timings"]["predicted_n"] == 200
    assert res["truncated"] is True and res["stop_type"] == "limit"
    assert res["tokens_evaluated"] + 200 > WINDOW
    short = post(srv, "/completion", {"prompt": "Hi", "n_predict": 4, "id_slot": "short"})
    assert short["truncated"] is False


def test_native_rows_follow_the_shifts(srv: ServerProc) -> None:
    ids = tokenize(srv.url, CHAT.format("Write a long list of animals."))
    body = {"input_ids": ids, "max_new_tokens": 150, "temperature": 0, "ignore_eos": True, "id_slot": "rows",
            "return_attention": True, "attention_format": "aggregated", "n_keep": -1}  # fmt: skip
    res = post(srv, "/api/v1/generate", body)
    gen = [t["token_id"] for t in res["generated_tokens"]]
    assert len(gen) == 150 and res["truncated"] is True
    ctx, shifts = list(ids), []
    for k, entry in enumerate(res["attention_data"]):
        att = entry["attention"]
        if "context_shift" in att:
            n_keep, n_discard = att["context_shift"]["n_keep"], att["context_shift"]["n_discard"]
            assert n_keep == len(ids)  # n_keep -1: the whole prompt
            del ctx[n_keep : n_keep + n_discard]
            shifts.append(n_discard)
        if k:
            ctx.append(gen[k - 1])
        assert att["context_length"] == len(ctx) == len(base64.b64decode(att["data"])) // 4, f"token {k}"
    assert shifts, "150 tokens after the prompt overflow a 128-token window"
    info = httpx.get(srv.url + "/v1/slots/rows/info", timeout=30).json()
    assert info["n_tokens"] == len(ctx) + 1 < WINDOW  # the last token is written after the answer
    preview = post(srv, "/api/v1/generate/preview", {"conversation_id": "rows", "max_tokens": 4, "temperature": 0})
    assert preview["cache_hit"] is True and preview["token_count"] == 4


def test_a_prompt_that_fills_the_window_is_refused(srv: ServerProc) -> None:
    r = httpx.post(srv.url + "/completion", json={"prompt": [1] * WINDOW, "n_predict": 4}, timeout=60)
    assert r.status_code == 400 and "exceeds the available context size" in r.text


def test_forked_choices_end_at_the_window(srv: ServerProc) -> None:
    """``n`` > 1 runs on copy-on-write forks of one prompt, which cannot shift (llama-server refuses a shift
    for a shared prompt too): with no ``max_tokens`` each choice ends at the window instead."""
    body = {"messages": [{"role": "user", "content": "Say many words."}], "n": 2, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    res = post(srv, "/v1/chat/completions", body)
    assert [c["finish_reason"] for c in res["choices"]] == ["length", "length"]
    n_prompt = res["usage"]["prompt_tokens"]
    assert res["usage"]["completion_tokens"] == 2 * (WINDOW - n_prompt)
