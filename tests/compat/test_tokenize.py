"""llama.cpp's ``tools/server/tests/unit/test_tokenize.py``, run against slotserve.

Ported from llama.cpp (MIT License, Copyright (c) 2023-2026 The ggml authors), as vendored
by llama-cpp-python 0.3.36.  Only the server changed (``utils.py`` here starts slotserve),
and one model-specific value, marked ``# slotserve:``: the preset model's BOS id is 1;
this server's model's BOS id is read from ``/props``.

Cannot apply: ``test_tokenize_with_bos``.  SmolLM2's GGUF sets
``tokenizer.ggml.add_bos_token = false``, so ``add_special`` adds no BOS here, and
llama-server answers the same for this model (it asks llama.cpp's tokenizer too).
"""

import pytest

from tests.compat.utils import *  # noqa: F403

server = ServerPreset.tinyllama2()  # noqa: F405


@pytest.fixture(autouse=True)
def create_server():
    global server
    server = ServerPreset.tinyllama2()  # noqa: F405


def test_tokenize_detokenize():
    global server
    server.start()
    # tokenize
    content = "What is the capital of France ?"
    res_tok = server.make_request("POST", "/tokenize", data={"content": content})
    assert res_tok.status_code == 200
    assert len(res_tok.body["tokens"]) > 5
    # detokenize
    res_detok = server.make_request(
        "POST",
        "/detokenize",
        data={
            "tokens": res_tok.body["tokens"],
        },
    )
    assert res_detok.status_code == 200
    assert res_detok.body["content"].strip() == content


@pytest.mark.skip(reason="this server's model does not add a BOS token (add_bos_token = false)")
def test_tokenize_with_bos():
    global server
    server.start()
    # tokenize
    content = "What is the capital of France ?"
    bos = server.make_request(
        "POST",
        "/tokenize",
        data={  # slotserve: was bosId = 1
            "content": server.make_request("GET", "/props").body["bos_token"],
            "parse_special": True,
        },
    ).body["tokens"]
    bosId = bos[0]
    res_tok = server.make_request(
        "POST",
        "/tokenize",
        data={
            "content": content,
            "add_special": True,
        },
    )
    assert res_tok.status_code == 200
    assert res_tok.body["tokens"][0] == bosId


def test_tokenize_with_pieces():
    global server
    server.start()
    # tokenize
    content = "This is a test string with unicode 媽 and emoji 🤗"
    res_tok = server.make_request(
        "POST",
        "/tokenize",
        data={
            "content": content,
            "with_pieces": True,
        },
    )
    assert res_tok.status_code == 200
    for token in res_tok.body["tokens"]:
        assert "id" in token
        assert token["id"] > 0
        assert "piece" in token
        assert len(token["piece"]) > 0
