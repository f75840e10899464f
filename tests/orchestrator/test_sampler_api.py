"""The further samplers through every API on the real server: grammar, JSON schema and
``response_format``, logit bias, presence/frequency penalties, Mirostat, DRY, XTC; bad values
and bad grammars refused with a code and the slot left as it was."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import ws_v1

YES_NO = 'root ::= "yes" | "no"'
QUESTION = CHAT.format("Is Paris in France? Answer yes or no.")
REPETITIVE = "one two three one two three one two three one two three one"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
          "required": ["city", "population"]}  # fmt: skip


DEEP = '{"items": ' * 3000 + "{}" + "}" * 3000  # a schema nested deeper than Python's recursion limit


class Answer(msgspec.Struct, forbid_unknown_fields=True):
    """What ``SCHEMA`` allows (decoding into it checks the schema)."""

    city: str
    population: int


def post(server: ServerProc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def completion(server: ServerProc, **body: object) -> httpx.Response:
    return post(server, "/completion", {"prompt": QUESTION, "n_predict": 8, "temperature": 0, **body})


def chat(server: ServerProc, content: str, **body: object) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    return post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 60, "temperature": 0, **body})


def slot_tokens(server: ServerProc, slot: str) -> list[int]:
    r = httpx.post(f"{server.url}/slots/{slot}", params={"action": "tokens"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def slot_listing(server: ServerProc, slot: str) -> dict[str, Any]:
    return {str(s["id"]): s for s in httpx.get(server.url + "/slots").json()}[slot]


def test_completion_grammar_and_settings(server: ServerProc) -> None:
    for seed in (1, 2, 3):
        r = completion(server, grammar=YES_NO, temperature=1.5, top_k=0, top_p=1.0, seed=seed, id_slot="smp-g")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] in ("yes", "no") and body["stop_type"] == "eos"
    settings = body["generation_settings"]
    assert settings["grammar"] == YES_NO and settings["samplers"][:2] == ["penalties", "dry"]


def test_completion_json_schema_matches(server: ServerProc) -> None:
    prompt = CHAT.format("Give the capital of France and its population as JSON.")
    r = completion(server, prompt=prompt, n_predict=60, json_schema=SCHEMA, id_slot="smp-js")
    assert r.status_code == 200, r.text
    assert r.json()["stop_type"] == "eos"
    assert msgspec.json.decode(r.json()["content"], type=Answer).city


def test_chat_response_format(server: ServerProc) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = chat(server, "Give the capital of France and its population as JSON.", response_format=fmt, user="smp-rf")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert msgspec.json.decode(choice["message"]["content"], type=Answer).city
    r = chat(server, 'Repeat this JSON exactly: {"answer": "yes"}', response_format={"type": "json_object"},
             max_tokens=30, user="smp-rf")  # fmt: skip
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = chat(server, "Hi", response_format={"type": "json_schema"}, user="smp-rf")
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"
    r = chat(server, "Hi", response_format={"type": "xml"}, user="smp-rf")
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completion", {"prompt": QUESTION, "n_predict": 4, "grammar": 'root ::= "yes'}),
        ("/completion", {"prompt": QUESTION, "n_predict": 4, "json_schema": {"$ref": "#/definitions/missing"}}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "array", "maxItems": 99999}},
                },
            },
        ),
        (
            "/api/v1/generate",
            {"prompt": QUESTION, "max_length": 4, "grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000},
        ),
        ("/api/extra/generate/stream", {"prompt": QUESTION, "max_length": 4, "grammar": "root ::= [a-"}),
        ("/api/v1/generate/preview", {"max_tokens": 4, "grammar": 'root ::= "yes'}),
        ("/api/v1/generate/preview", {"max_tokens": 4, "json_schema": {"$ref": "#/definitions/missing"}}),
    ],
)
def test_bad_grammar_is_400_and_the_slot_is_unchanged(server: ServerProc, path: str, body: dict[str, Any]) -> None:
    slot = "smp-bad"
    first = post(server, "/api/v1/generate", {"prompt": QUESTION, "max_length": 3, "temperature": 0, "conversation_id": slot})  # fmt: skip
    assert first.status_code == 200, first.text
    before, listed = slot_tokens(server, slot), slot_listing(server, slot)
    named = {"/completion": "id_slot", "/v1/chat/completions": "slot_id", "/api/v1/generate": "conversation_id"}.get(
        path, "conversation_id"
    )
    r = post(server, path, {**body, named: slot})
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == "INVALID_GRAMMAR"
    assert slot_tokens(server, slot) == before
    after = slot_listing(server, slot)
    assert after["n_tokens"] == listed["n_tokens"] == len(before) and after["id_task"] == listed["id_task"]


def test_bad_grammar_over_the_websocket(server: ServerProc) -> None:
    ev = ws_v1(server.ws_url, [{"type": "generate", "prompt": QUESTION, "max_new_tokens": 3, "grammar": "root ::= x"},
                               {"type": "generate", "prompt": QUESTION, "max_new_tokens": 3, "grammar": YES_NO,
                                "temperature": 0}], until_done=2)  # fmt: skip
    assert ev[0]["type"] == "error" and ev[0]["error_code"] == "INVALID_GRAMMAR"
    text = "".join(e["token"]["text"] for e in ev if e["type"] == "token")
    assert ev[-1]["type"] == "done" and text.removesuffix("<|im_end|>") in ("yes", "no")


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/completion", {"mirostat": 3}, "INVALID_REQUEST"),
        ("/completion", {"xtc_probability": 1.5}, "INVALID_REQUEST"),
        ("/completion", {"dry_multiplier": -1}, "INVALID_REQUEST"),
        ("/completion", {"dry_sequence_breakers": []}, "INVALID_REQUEST"),
        ("/completion", {"logit_bias": [[10**6, 1.0]]}, "INVALID_TOKEN"),
        ("/completion", {"logit_bias": {"5": "a lot"}}, "INVALID_REQUEST"),
        ("/completion", {"logit_bias": [[5, True]]}, "INVALID_REQUEST"),
        ("/completion", {"logit_bias": {"-3": -1}}, "INVALID_TOKEN"),
        ("/v1/chat/completions", {"presence_penalty": "high"}, "INVALID_REQUEST"),
        ("/api/v1/generate", {"typical": 2}, "INVALID_REQUEST"),
        ("/api/v1/generate", {"dry_multiplier": 1, "dry_sequence_breakers": "[not json"}, "INVALID_REQUEST"),
        ("/api/v1/generate/preview", {"xtc_probability": 1.5}, "INVALID_REQUEST"),
        ("/api/v1/generate/preview", {"min_p": -0.5}, "INVALID_REQUEST"),
        ("/api/v1/generate/preview", {"logit_bias": [[10**6, 1.0]]}, "INVALID_TOKEN"),
    ],
)
def test_bad_sampler_values_are_refused(server: ServerProc, path: str, body: dict[str, Any], code: str) -> None:
    base: dict[str, Any] = {"prompt": QUESTION, "n_predict": 2}
    if path == "/v1/chat/completions":
        base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    if path == "/api/v1/generate/preview":
        base = {"input_ids": [1, 2, 3], "use_cached_context": False, "max_tokens": 2}
    r = post(server, path, {**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == code


def test_logit_bias_through_each_api(server: ServerProc) -> None:
    plain = completion(server, n_predict=4, return_tokens=True, ignore_eos=True, id_slot="smp-lb").json()
    top = plain["tokens"][0]
    banned = completion(server, n_predict=4, return_tokens=True, ignore_eos=True, id_slot="smp-lb",
                        logit_bias=[[top, False]]).json()  # fmt: skip
    assert top not in banned["tokens"]
    by_text = completion(server, n_predict=4, return_tokens=True, ignore_eos=True, id_slot="smp-lb",
                         logit_bias=[[plain["content"][:3], False]]).json()  # fmt: skip
    assert top not in by_text["tokens"]  # the text's tokens are all banned
    forced = chat(server, "Hi", max_tokens=3, logit_bias={"42": 100}, user="smp-lb").json()
    assert forced["choices"][0]["message"]["content"] == httpx.post(server.url + "/detokenize", json={"tokens": [42] * 3}).json()["content"]  # fmt: skip
    kobold = post(server, "/api/v1/generate", {"prompt": QUESTION, "max_length": 3, "temperature": 0,
                                                "logit_bias": {"42": 100}, "conversation_id": "smp-lb"}).json()  # fmt: skip
    assert [t["token_id"] for t in kobold["generated_tokens"]] == [42, 42, 42]


def test_openai_penalties_change_greedy_output(server: ServerProc) -> None:
    def run(**kw: object) -> str:
        r = post(server, "/v1/completions", {"prompt": REPETITIVE, "max_tokens": 10, "temperature": 0, "user": "smp-pen", **kw})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    plain = run()
    assert "two three" in plain  # greedy continues the pattern
    assert run(presence_penalty=1.5) != plain
    assert run(frequency_penalty=1.5) != plain


def test_kobold_samplers_are_honoured_without_warning(server: ServerProc) -> None:
    body = {"prompt": QUESTION, "max_length": 12, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "sampler_seed": 5, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "typical": 0.9,
            "dry_multiplier": 0.8, "dry_sequence_breakers": '["\\n", ":"]', "xtc_probability": 0.5,
            "xtc_threshold": 0.1, "nsigma": 1.0, "presence_penalty": 0.3, "bypass_eos": True, "dynatemp_range": 0.4,
            "conversation_id": "smp-kb"}  # fmt: skip
    warned = server.log_path.read_text(errors="replace").count("Kobold fields not supported")
    r = post(server, "/api/v1/generate", body)
    assert r.status_code == 200, r.text
    params = slot_listing(server, "smp-kb")["params"]  # what the engine was given (llama-server's names)
    assert params["mirostat"] == 2 and params["mirostat_tau"] == 3.0 and params["typical_p"] == pytest.approx(0.9)
    assert params["dry_multiplier"] == pytest.approx(0.8) and params["dry_sequence_breakers"] == ["\n", ":"]
    assert params["xtc_probability"] == 0.5 and params["top_n_sigma"] == 1.0
    assert params["presence_penalty"] == pytest.approx(0.3) and params["seed"] == 5
    assert params["dynatemp_range"] == pytest.approx(0.4) and params["dynatemp_exponent"] == 1.0
    assert server.log_path.read_text(errors="replace").count("Kobold fields not supported") == warned
    r = post(server, "/api/v1/generate", {**body, "top_a": 0.5, "max_length": 1})  # still unsupported: warned
    assert r.status_code == 200
    assert server.log_path.read_text(errors="replace").count("Kobold fields not supported") == warned + 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/generate", '{"prompt": "Hi", "max_length": 2, "json_schema": %s}'),
        ("/completion", '{"prompt": "Hi", "n_predict": 2, "json_schema": %s}'),
        (
            "/v1/chat/completions",
            '{"messages": [], "max_tokens": 2, "response_format": {"type": "json_object", "schema": %s}}',
        ),
    ],
)
def test_deeply_nested_schema_is_400(server: ServerProc, path: str, body: str) -> None:
    r = httpx.post(server.url + path, content=body % DEEP, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == "INVALID_REQUEST"


def test_preview_takes_the_generation_samplers(server: ServerProc) -> None:
    """A preview honours a grammar and a logit bias, on a fork, and leaves the slot as it was."""
    slot = "smp-pv"
    first = post(server, "/api/v1/generate", {"prompt": QUESTION, "max_length": 2, "temperature": 0, "conversation_id": slot})  # fmt: skip
    assert first.status_code == 200, first.text
    before = slot_tokens(server, slot)
    texts = set()
    for seed in range(4):
        body = {"conversation_id": slot, "max_tokens": 8, "temperature": 1.5, "top_k": 0, "top_p": 1.0,
                "seed": seed, "grammar": 'root ::= " yes" | " no"'}  # fmt: skip
        r = post(server, "/api/v1/generate/preview", body)
        assert r.status_code == 200, r.text
        assert r.json()["cache_hit"] is True
        texts.add(r.json()["text"])
    assert texts <= {" yes", " no"}, texts
    forced = post(server, "/api/v1/generate/preview",
                  {"conversation_id": slot, "max_tokens": 3, "logit_bias": {"42": 100}, "temperature": 0})  # fmt: skip
    assert forced.status_code == 200, forced.text
    assert [t["token_id"] for t in forced.json()["tokens"]] == [42, 42, 42]
    assert slot_tokens(server, slot) == before
