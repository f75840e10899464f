"""llama.cpp's ``tools/server/tests/unit/test_slot_save.py``, run against slotserve.

Ported from llama.cpp (MIT License, Copyright (c) 2023-2026 The ggml authors), as vendored
by llama-cpp-python 0.3.36.  The test code is llama.cpp's; what changed, each marked
``# slotserve:``:

* the server: ``utils.py`` here starts slotserve with the preset's settings;
* model-specific expectations: llama.cpp's preset model (stories260K) writes about
  "Whiskers"/"Flana" and tokenizes the prompts to 21 tokens (6 of them differing); this
  server's model (SmolLM2-135M, an instruct model) answers these bare prompts with its
  end-of-turn token at once, so the counts are computed from ``/tokenize`` and the
  content checks only require a string;
* ``n_saved``: llama-server leaves its last sampled token out of the KV cache
  (prompt + 64 - 1 = 84); slotserve commits it, so a slot holds prompt + generated.

Cases that cannot apply (not ported): the five multimodal cases (``mmproj_server``: they
need the tinygemma3 vision model and its mmproj downloaded from Hugging Face, and slotserve
serves text models only; it refuses a file holding media chunks with ``BAD_STATE``).
"""

import os
import struct

import pytest

from tests.compat.utils import *  # noqa: F403

# sequence state file: magic(4) version(4) payload_size(4), then payload_size llama_token words
STATE_FILE_HEADER_SIZE = 12

server = ServerPreset.tinyllama2()  # noqa: F405


@pytest.fixture(autouse=True)
def create_server(tmp_path):
    global server
    server = ServerPreset.tinyllama2()  # noqa: F405
    server.slot_save_path = str(tmp_path)
    server.temperature = 0.0


def n_tokens(text):  # slotserve: the prompt's length with this server's model
    return len(server.make_request("POST", "/tokenize", data={"content": text, "add_special": True}).body["tokens"])


def n_differing(a, b):  # slotserve: tokens of b after its common prefix with a
    ta = server.make_request("POST", "/tokenize", data={"content": a, "add_special": True}).body["tokens"]
    tb = server.make_request("POST", "/tokenize", data={"content": b, "add_special": True}).body["tokens"]
    common = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
    return len(tb) - common


def test_slot_save_restore():
    global server
    server.start()
    france, germany = "What is the capital of France?", "What is the capital of Germany?"

    # First prompt in slot 1 should be fully processed
    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": france,
            "id_slot": 1,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    assert isinstance(res.body["content"], str)  # slotserve: was match_regex("(Whiskers|Flana)+", ...)
    assert res.body["timings"]["prompt_n"] == n_tokens(france)  # all tokens are processed
    n_kept = res.body["timings"]["prompt_n"] + res.body["tokens_predicted"]  # slotserve: see the docstring

    # Save state of slot 1
    res = server.make_request(
        "POST",
        "/slots/1?action=save",
        data={
            "filename": "slot1.bin",
        },
    )
    assert res.status_code == 200
    assert res.body["n_saved"] == n_kept

    # Since we have cache, this should only process the last tokens
    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": germany,
            "id_slot": 1,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    assert isinstance(res.body["content"], str)  # slotserve: was match_regex("(Jack|said)+", ...)
    assert res.body["timings"]["prompt_n"] == n_differing(france, germany)  # only different part is processed

    # Loading the saved cache into slot 0
    res = server.make_request(
        "POST",
        "/slots/0?action=restore",
        data={
            "filename": "slot1.bin",
        },
    )
    assert res.status_code == 200
    assert res.body["n_restored"] == n_kept

    # Since we have cache, slot 0 should only process the last tokens
    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": germany,
            "id_slot": 0,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    assert isinstance(res.body["content"], str)
    assert res.body["timings"]["prompt_n"] == n_differing(france, germany)  # only different part is processed

    # For verification that slot 1 was not corrupted during slot 0 load, same thing should work
    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": germany,
            "id_slot": 1,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    assert isinstance(res.body["content"], str)
    assert res.body["timings"]["prompt_n"] == 1


def test_slot_restore_legacy_token_list():
    global server
    server.start()
    france, germany = "What is the capital of France?", "What is the capital of Germany?"

    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": france,
            "id_slot": 1,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    n_kept = res.body["timings"]["prompt_n"] + res.body["tokens_predicted"]

    res = server.make_request(
        "POST",
        "/slots/1?action=save",
        data={
            "filename": "slot_legacy.bin",
        },
    )
    assert res.status_code == 200
    assert res.body["n_saved"] == n_kept

    # rewrite the token payload into a plain token list, as written by servers that predate the packed server_tokens format
    path = os.path.join(server.slot_save_path, "slot_legacy.bin")
    with open(path, "rb") as f:
        data = bytearray(f.read())

    # the payload written by this server starts with a packed header: LLAMA_TOKEN_NULL(4) version(4) n_tokens(4)
    packed_header_size = 12

    payload_size = struct.unpack_from("=I", data, STATE_FILE_HEADER_SIZE - 4)[0]
    payload_end = STATE_FILE_HEADER_SIZE + payload_size * 4
    n_tokens_saved = struct.unpack_from("=I", data, STATE_FILE_HEADER_SIZE + 8)[0]
    assert n_tokens_saved == n_kept

    tokens_start = STATE_FILE_HEADER_SIZE + packed_header_size
    data = data[:STATE_FILE_HEADER_SIZE] + data[tokens_start : tokens_start + n_tokens_saved * 4] + data[payload_end:]
    struct.pack_into("=I", data, STATE_FILE_HEADER_SIZE - 4, n_tokens_saved)

    with open(path, "wb") as f:
        f.write(data)

    # the plain token list must restore, and the restored KV must be reusable
    res = server.make_request(
        "POST",
        "/slots/0?action=restore",
        data={
            "filename": "slot_legacy.bin",
        },
    )
    assert res.status_code == 200
    assert res.body["n_restored"] == n_kept

    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": germany,
            "id_slot": 0,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    assert res.body["timings"]["prompt_n"] == n_differing(france, germany)  # only the different part is processed


def test_slot_erase():
    global server
    server.start()
    france = "What is the capital of France?"

    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": france,
            "id_slot": 1,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    assert isinstance(res.body["content"], str)
    assert res.body["timings"]["prompt_n"] == n_tokens(france)  # all tokens are processed

    # erase slot 1
    res = server.make_request("POST", "/slots/1?action=erase")
    assert res.status_code == 200

    # re-run the same prompt, it should process all tokens again
    res = server.make_request(
        "POST",
        "/completion",
        data={
            "prompt": france,
            "id_slot": 1,
            "cache_prompt": True,
        },
    )
    assert res.status_code == 200
    assert isinstance(res.body["content"], str)
    assert res.body["timings"]["prompt_n"] == n_tokens(france)  # all tokens are processed
