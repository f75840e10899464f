"""llama-server's native API on slotserve: /completion, /props, /slots fields, its error shape."""

from __future__ import annotations

import json

import httpx

from tests.conftest import ServerProc

PROMPT = "What is the capital of France?"


def completion(server: ServerProc, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 6, "temperature": 0, **body},
                      timeout=120)  # fmt: skip


def test_completion_fields_and_timings(server: ServerProc) -> None:
    r = completion(server, id_slot=21, n_probs=3, return_tokens=True)
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["stop"] is True and b["id_slot"] == 21 and b["tokens_predicted"] == len(b["tokens"])
    assert b["stop_type"] in ("limit", "eos") and b["model"] and b["generation_settings"]["n_predict"] == 6
    t = b["timings"]
    assert t["cache_n"] == 0 and t["prompt_n"] == b["tokens_evaluated"] and t["predicted_n"] == b["tokens_predicted"]
    probs = b["completion_probabilities"]
    assert [p["id"] for p in probs] == b["tokens"]
    assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)
    again = completion(server, id_slot=21).json()["timings"]  # same prompt: everything but the last token cached
    assert again["prompt_n"] == 1 and again["cache_n"] == t["prompt_n"] - 1


def test_prompt_as_token_ids_and_cache_prompt_false(server: ServerProc) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    a = completion(server, prompt=ids, id_slot="ls-ids").json()
    b = completion(server, id_slot="ls-ids2").json()
    assert a["content"] == b["content"] and a["tokens_evaluated"] == len(ids)
    c = completion(server, id_slot="ls-ids", cache_prompt=False).json()
    assert c["timings"]["cache_n"] == 0 and c["timings"]["prompt_n"] == len(ids)


def test_completion_stream(server: ServerProc) -> None:
    chunks = []
    with httpx.stream("POST", server.url + "/completion", json={"prompt": PROMPT, "n_predict": 5, "temperature": 0,
                      "stream": True, "id_slot": "ls-stream", "n_probs": 2, "ignore_eos": True}, timeout=120) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert chunks[-1]["stop"] is True and "timings" in chunks[-1]
    parts = chunks[:-1]
    assert all(c["stop"] is False and len(c["completion_probabilities"]) >= 1 for c in parts)
    whole = completion(server, n_predict=5, id_slot="ls-stream", ignore_eos=True).json()
    assert "".join(c["content"] for c in parts) == whole["content"] != ""


def test_props_and_slots_fields(server: ServerProc) -> None:
    props = httpx.get(server.url + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 2048
    assert "<|im_start|>" in props["chat_template"] and props["model_path"].endswith(".gguf")
    completion(server, id_slot=22, ignore_eos=True)
    slots = {s["id"]: s for s in httpx.get(server.url + "/slots").json()}
    s = slots[22]
    assert s["id_task"] >= 0 and s["params"]["n_predict"] == 6 and s["params"]["temperature"] == 0
    # an idle slot reports no budget left over from its finished task, as llama-server (n_decoded 0, n_remain -1)
    assert s["next_token"][0]["n_decoded"] == 0 and s["next_token"][0]["n_remain"] == -1
    assert s["next_token"][0]["has_next_token"] is False
    assert s["n_prompt_tokens_processed"] > 0 and s["is_processing"] is False


def test_errors_have_llama_server_shape(server: ServerProc) -> None:
    r = httpx.post(server.url + "/slots/-1?action=erase")
    assert r.status_code == 400 and r.json()["error"] == {"code": 400, "message": "Invalid slot ID",
                                                          "type": "invalid_request_error"}  # fmt: skip
    r = httpx.post(server.url + "/slots/nope-x?action=erase")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = completion(server, prompt=[10**9])
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_TOKEN" and r.json()["error"]["message"]
    r = completion(server, n_predict=100_000)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == 2048
    r = httpx.post(server.url + "/completion", json={"n_predict": 3})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/tokenize", content=b"{")
    assert r.status_code == 400 and "message" in r.json()["error"]
