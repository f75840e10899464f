"""Hostile input gets a clear 4xx and changes nothing (issue 13, found 3, 4 and 5)."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import tokenize, ws_binary, ws_v1

HUGE = 2**70


@pytest.fixture(scope="module")
def ids(server: ServerProc) -> list[int]:
    return tokenize(server.url, CHAT.format("Say hello."))


def post(server: ServerProc, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)  # type: ignore[arg-type]


def assert_400(r: httpx.Response, code: str = "INVALID_REQUEST") -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == code, r.text


def ws_error_of(
    server: ServerProc, body: dict[str, object] | str | bytes
) -> tuple[dict[str, object], dict[str, object]]:
    """The error each WebSocket endpoint answers ``body`` with (binary stream, JSON events)."""
    with connect(server.ws_url + "/api/extra/generate/stream/ws", close_timeout=2) as ws:
        ws.send(body if isinstance(body, str | bytes) else json.dumps(body))
        binary = json.loads(ws.recv(timeout=60))
    events = ws_v1(server.ws_url, [body if isinstance(body, str) else json.dumps(body)])  # type: ignore[list-item]
    return binary, events[0]


# ---------------------------------------------------------------------------- found 3


def test_huge_seed_is_a_400_everywhere(server: ServerProc, ids: list[int]) -> None:
    body = {"input_ids": ids, "max_new_tokens": 2, "seed": HUGE, "id_slot": "h-seed"}
    assert_400(post(server, "/api/v1/generate", body))
    assert_400(post(server, "/api/extra/generate/stream", {**body, "seed": None, "sampler_seed": HUGE}))
    assert_400(post(server, "/api/v1/generate/preview", {"input_ids": ids, "seed": HUGE, "use_cached_context": False}))
    for ev in ws_error_of(server, body):
        assert ev["type"] == "error" and ev["error_code"] == "INVALID_REQUEST", ev
    assert post(server, "/api/v1/generate", {**body, "seed": 2**32 - 1}).status_code == 200  # uint32 is fine


def test_invalid_utf8_is_a_400(server: ServerProc) -> None:
    raw = b'{"prompt": "caf\xc3\x28 \xff", "text": "\xff", "conversation_id": "\xc3\x28", "max_new_tokens": 1}'
    compat = b'{"prompt": "caf\xc3\x28", "messages": [{"role": "user", "content": "\xff"}], "max_tokens": 1}'
    paths = {"/api/v1/generate": raw, "/api/v1/tokenize": raw, "/api/v1/generate/preview": raw}
    # OpenAI's and llama-server's paths decode with Litestar's own (lenient) conversion: the same refusal
    for path in ("/v1/completions", "/v1/chat/completions", "/chat/completions", "/completion", "/completions"):
        paths[path] = compat
    for path, body in paths.items():
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "INVALID_REQUEST" in r.text and "utf-8" in r.text.lower(), (path, r.text)
    with connect(server.ws_url + "/api/extra/generate/stream/ws", close_timeout=2) as ws:
        ws.send(raw)  # a binary frame: the bytes reach the JSON decoder as they are
        ev = json.loads(ws.recv(timeout=60))
    assert ev["type"] == "error" and ev["error_code"] == "INVALID_REQUEST", ev
    with connect(server.ws_url + "/api/v1/generate/stream", close_timeout=2) as ws:
        ws.send(raw)
        ev = json.loads(ws.recv(timeout=60))
        assert ev["type"] == "error" and ev["error_code"] == "INVALID_REQUEST", ev
        ws.send(json.dumps({"input_ids": [1, 2], "max_new_tokens": 1}))  # the socket still serves
        assert json.loads(ws.recv(timeout=60))["type"] in ("token", "done")


@pytest.mark.parametrize("slot", ["", "x" * 300, "a\nb"])
def test_bad_preview_slot_id_is_a_400(server: ServerProc, slot: str) -> None:
    assert_400(post(server, "/api/v1/generate/preview", {"conversation_id": slot, "max_tokens": 1}))


def test_bad_file_names_in_file_actions(server: ServerProc, ids: list[int]) -> None:
    save_dir = server.workdir / "slots"
    assert post(server, "/api/v1/generate", {"input_ids": ids, "max_new_tokens": 1, "id_slot": "h-file"}).is_success
    (save_dir / "a-directory").mkdir(parents=True, exist_ok=True)
    for name in ("n" * 300, "a-directory"):
        for action in ("save", "restore"):
            r = post(server, "/slots/h-file", {"filename": name}, params={"action": action})
            assert_400(r)
    assert not list(save_dir.glob(".*.tmp"))  # nothing left behind
    assert_400(post(server, "/slots/" + "y" * 2000, {}, params={"action": "restore-state"}))


# ---------------------------------------------------------------------------- found 4


def test_refused_restore_creates_no_slot(server: ServerProc) -> None:
    (server.workdir / "slots").mkdir(exist_ok=True)
    (server.workdir / "slots" / "garbage.bin").write_bytes(b"not a state at all")
    for name, code in (("missing.bin", "INVALID_REQUEST"), ("garbage.bin", "BAD_STATE")):
        r = post(server, "/slots/h-new", {"filename": name}, params={"action": "restore"})
        assert_400(r, code)
        r = post(server, "/slots/h-new", None, params={"action": "tokens"})
        assert r.status_code == 404 and r.json()["error_code"] == "SLOT_NOT_FOUND", r.text
    assert "h-new" not in {str(s["id"]) for s in httpx.get(server.url + "/slots").json()}


# ---------------------------------------------------------------------------- found 5


OUT_OF_RANGE = [
    {"top_k": 2**40},
    {"top_k": 2**63},
    {"repeat_last_n": 2**40},
    {"repeat_last_n": -5},
    {"rep_pen_range": -2},
    {"repetition_penalty": 1e300},
    {"rep_pen": -1.0},
    {"temperature": 1e39},
    {"top_p": 1.5},
    {"min_p": -0.1},
    {"max_new_tokens": "10"},
    {"max_new_tokens": 2**40},
    {"n_probs": 101},
]


@pytest.mark.parametrize("extra", OUT_OF_RANGE, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items())[:40])
def test_out_of_range_values_are_refused_on_every_path(server: ServerProc, ids: list[int], extra: dict) -> None:  # type: ignore[type-arg]
    body = {"input_ids": ids, "max_new_tokens": 2, "id_slot": "h-range", **extra}
    for path in ("/api/v1/generate", "/api/extra/generate/stream"):
        r = post(server, path, body)
        assert_400(r)
        assert next(iter(extra)) in r.json()["error"], r.text  # the message names the field
    for ev in ws_error_of(server, body):
        assert ev["type"] == "error" and ev["error_code"] == "INVALID_REQUEST", ev


def test_strict_types_on_every_path(server: ServerProc) -> None:
    assert_400(post(server, "/api/v1/detokenize", {"token_ids": ["1"]}))
    assert_400(post(server, "/detokenize", {"tokens": ["1"]}))
    assert_400(post(server, "/api/v1/tokenize", {"text": "hi", "with_pieces": "true"}))
    assert_400(post(server, "/api/v1/generate/preview", {"input_ids": [1], "max_tokens": "3"}))


def test_negative_temperature_is_greedy(server: ServerProc, ids: list[int]) -> None:
    common = {"input_ids": ids, "max_new_tokens": 5, "ignore_eos": True}
    cold = post(server, "/api/v1/generate", {**common, "temperature": -1, "seed": 7, "id_slot": "h-t1"})
    zero = post(server, "/api/v1/generate", {**common, "temperature": 0, "id_slot": "h-t2"})
    assert cold.status_code == 200, cold.text
    assert [t["token_id"] for t in cold.json()["generated_tokens"]] == [
        t["token_id"] for t in zero.json()["generated_tokens"]
    ]
    r = post(server, "/api/v1/generate/preview", {"input_ids": ids, "temperature": -1, "use_cached_context": False})
    assert r.status_code == 200, r.text
    ok = ws_binary(server.ws_url, {**common, "temperature": -0.5, "repeat_last_n": -1, "repeat_penalty": 1.1})
    assert ok.error is None and ok.done is not None
