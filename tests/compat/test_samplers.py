"""llama.cpp's grammar, JSON-schema, ``response_format`` and ``logit_bias`` server tests, run
against slotserve.

Ported from llama.cpp (MIT License, Copyright (c) 2023-2026 The ggml authors), as vendored by
llama-cpp-python 0.3.36: ``tools/server/tests/unit/test_chat_completion.py``
(``test_completion_with_response_format``, ``test_completion_with_json_schema``,
``test_completion_with_grammar``, ``test_completion_with_invalid_grammar``, ``test_logit_bias``)
and ``test_completion.py`` (``test_logit_bias``, here ``test_completion_logit_bias``).  Only the
server changed (``utils.py`` here starts slotserve) and the port, marked ``# slotserve:``; every
expectation held on this server's SmolLM2 as written.

A subset of the parameter lists (each case starts a server, about half a minute on a loaded
2-core machine): ``response_format`` keeps one valid case of each type and the refused ones
whose refusal is ours (an unknown type, a schema the converter refuses), ``jinja`` only true
(slotserve always renders with jinja2), ``test_logit_bias`` of ``/completion`` the two mixed
forms (texts as object keys, ids as pairs).  All of them passed here (18 cases, 11 min).
"""

import pytest
from openai import OpenAI

from tests.compat.utils import *  # noqa: F403

server = ServerPreset.tinyllama2()  # noqa: F405


@pytest.fixture(autouse=True)
def create_server():
    global server
    server = ServerPreset.tinyllama2()  # noqa: F405


@pytest.mark.parametrize("response_format,n_predicted,re_content", [
    ({"type": "json_object", "schema": {"const": "42"}}, 6, "\"42\""),
    ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, 10, "\"foooooo\""),
    ({"type": "sound"}, 0, None),
    # invalid response format (expected to fail)
    ({"type": "json_object", "schema": {"type": "hiccup"}}, 0, None),
])  # fmt: skip
def test_completion_with_response_format(response_format: dict, n_predicted: int, re_content: str | None):
    global server
    server.start()
    res = server.make_request("POST", "/chat/completions", data={
        "max_tokens": n_predicted,
        "messages": [
            {"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": "Write an example"},
        ],
        "response_format": response_format,
    })  # fmt: skip
    if re_content is not None:
        assert res.status_code == 200
        choice = res.body["choices"][0]
        assert match_regex(re_content, choice["message"]["content"])  # noqa: F405
    else:
        assert res.status_code == 400
        assert "error" in res.body


@pytest.mark.parametrize("jinja,json_schema,n_predicted,re_content", [
    (True, {"const": "42"}, 6, "\"42\""),
])  # fmt: skip
def test_completion_with_json_schema(jinja: bool, json_schema: dict, n_predicted: int, re_content: str):
    global server
    server.jinja = jinja
    server.debug = True
    server.start()
    res = server.make_request("POST", "/chat/completions", data={
        "max_tokens": n_predicted,
        "messages": [
            {"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": "Write an example"},
        ],
        "json_schema": json_schema,
    })  # fmt: skip
    assert res.status_code == 200, f"Expected 200, got {res.status_code}"
    choice = res.body["choices"][0]
    assert match_regex(re_content, choice["message"]["content"]), (  # noqa: F405
        f"Expected {re_content}, got {choice['message']['content']}"
    )


@pytest.mark.parametrize("jinja,grammar,n_predicted,re_content", [
    (True, 'root ::= "a"{5,5}', 6, "a{5,5}"),
])  # fmt: skip
def test_completion_with_grammar(jinja: bool, grammar: str, n_predicted: int, re_content: str):
    global server
    server.jinja = jinja
    server.start()
    res = server.make_request("POST", "/chat/completions", data={
        "max_tokens": n_predicted,
        "messages": [
            {"role": "user", "content": "Does not matter what I say, does it?"},
        ],
        "grammar": grammar,
    })  # fmt: skip
    assert res.status_code == 200, res.body
    choice = res.body["choices"][0]
    assert match_regex(re_content, choice["message"]["content"]), choice["message"]["content"]  # noqa: F405


def test_completion_with_invalid_grammar():
    global server
    server.start()
    res = server.make_request("POST", "/chat/completions", data={
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Does not matter what I say, does it?"},
        ],
        "grammar": "root ::= this is (not valid GBNF",
    })  # fmt: skip
    assert res.status_code == 400, res.body
    assert "error" in res.body


EXCLUDE = ["i", "I", "the", "The", "to", "a", "an", "be", "is", "was", "but", "But", "and", "And", "so", "So", "you", "You", "he", "He", "she", "She", "we", "We", "they", "They", "it", "It", "his", "His", "her", "Her", "book", "Book"]  # fmt: skip


def test_logit_bias():
    global server
    server.start()

    exclude = EXCLUDE

    res = server.make_request("POST", "/tokenize", data={
        "content": " " + " ".join(exclude) + " ",
    })  # fmt: skip
    assert res.status_code == 200
    tokens = res.body["tokens"]
    logit_bias = {tok: -100 for tok in tokens}

    client = OpenAI(api_key="dummy", base_url=f"http://127.0.0.1:{server.port}/v1")  # slotserve: the port
    res = client.chat.completions.create(
        model="gpt-3.5-turbo-instruct",
        temperature=0.0,
        messages=[
            {"role": "system", "content": "Book"},
            {"role": "user", "content": "What is the best book"},
        ],
        max_tokens=64,
        logit_bias=logit_bias
    )  # fmt: skip
    output_text = res.choices[0].message.content
    assert output_text
    assert all(output_text.find(" " + tok + " ") == -1 for tok in exclude)


@pytest.mark.parametrize("tokenize,openai_style", [(False, True), (True, False)])
def test_completion_logit_bias(tokenize, openai_style):
    global server
    server.start()

    exclude = EXCLUDE

    logit_bias = []
    if tokenize:
        res = server.make_request("POST", "/tokenize", data={
            "content": " " + " ".join(exclude) + " ",
        })  # fmt: skip
        assert res.status_code == 200
        tokens = res.body["tokens"]
        logit_bias = [[tok, -100] for tok in tokens]

    else:
        logit_bias = [[" " + tok + " ", -100] for tok in exclude]

    if openai_style:
        logit_bias = {el[0]: -100 for el in logit_bias}

    res = server.make_request("POST", "/completion", data={
        "n_predict": 64,
        "prompt": "What is the best book",
        "logit_bias": logit_bias,
        "temperature": 0.0
    })  # fmt: skip
    assert res.status_code == 200
    output_text = res.body["content"]
    assert all(output_text.find(" " + tok + " ") == -1 for tok in exclude)
