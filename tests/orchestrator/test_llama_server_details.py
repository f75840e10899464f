"""llama-server's details on slotserve (issue 21, item 3): ``/slots`` as llama-server lists its
slots, ``/apply-template``, ``/chat/completions/input_tokens``, ``response_fields``, several
prompts in one ``/completion``, ``{"prompt_string"}``, ``system_fingerprint``, ``--alias``/``--tags``
in ``/v1/models``, ``--seed``, the first streamed chat chunk, the overflow message, CORS preflight,
unknown routes and two assistant messages at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerProc

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("details")
    s = ServerProc(["--parallel", "2", "--ctx-size", "512", "--threads", "2", "--seed", "42", "--alias",
                    "tiny,code, fim", "--tags", "chat,small", "--state-dir", str(work / "state")], work)  # fmt: skip
    s.start()
    yield s
    s.stop()


def post(srv: ServerProc, path: str, body: object, status: int = 200) -> dict:  # type: ignore[type-arg]
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()  # type: ignore[no-any-return]


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
