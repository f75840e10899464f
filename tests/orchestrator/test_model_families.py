"""A sliding-window and a recurrent model served end to end (tiny models of tests/tiny_models.py).

gpt-oss (two KV caches, one of them with gpt-oss's 128-token sliding window; attention sinks) through the
server: its attention against transformers' eager attention on a prompt past the sliding cache's 256 cells, after its slot was parked
in the store and came back, after a restart of the server (the same tokens resent, and more), and after its state went out through
``save-state`` and back in through ``restore-state``.  Mamba (a recurrent state, no attention): it
generates, and the requests its memory cannot serve are refused with the limitation named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.orchestrator.client import decode_attention, tokenize
from tests.tiny_models import FAMILIES, Reference, assert_matches, build_tiny_gguf

pytestmark = pytest.mark.slow

TEXT = "the quick brown fox pays attention to the lazy dog, a model pays attention to the words"


def generate(url: str, slot: str, ids: list[int], attention: bool = True, n: int = 3) -> dict[str, Any]:
    body = {"input_ids": ids, "max_new_tokens": n, "temperature": 0, "ignore_eos": True, "id_slot": slot,
            "return_attention": attention}  # fmt: skip
    r = httpx.post(url + "/api/v1/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def matches(ref: Reference, what: str, ids: list[int], out: dict[str, Any], layers: list[int]) -> float:
    tokens = [t["token_id"] for t in out["generated_tokens"]]
    rows = [decode_attention(t["attention"]) for t in out.get("attention_data") or []]
    return assert_matches(ref, what, ids, tokens, rows, layers)


def test_sliding_window_model_through_the_server(start_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    gguf = build_tiny_gguf("gpt-oss", tmp_path / "gpt-oss")
    ref = Reference(gguf.parent)
    args = ("--model", str(gguf), "--parallel", "1", "--ctx-size", "512", "--batch-size", "32", "--ubatch-size", "32",
            "-ctk", "f32", "-ctv", "f32", "--state-dir", str(tmp_path / "st"))  # fmt: skip
    srv = start_server(*args)
    info = httpx.get(srv.url + "/api/v1/model").json()
    assert info["memory"]["type"] == "iswa" and info["memory"]["kv_caches"] == 2
    assert info["attention_layers"] == [0, 1, 2, 3]
    assert info["attention_windows"] == list(FAMILIES["gpt-oss"].windows)
    layers = info["attention_layers"]
    ids = tokenize(srv.url, " ".join([TEXT] * 30))[:300]

    first = generate(srv.url, "a", ids)
    matches(ref, "first", ids, first, layers)
    ids += [t["token_id"] for t in first["generated_tokens"]]

    generate(srv.url, "b", ids[:20], attention=False)  # one slot resident: "a" is parked in the store
    assert next(s for s in httpx.get(srv.url + "/slots").json() if s["id"] == "a")["place"] == "parked"
    ids.append(ids[7])
    back = generate(srv.url, "a", ids)
    assert back["cached_tokens"] == len(ids) - 1, "the parked state came back (both caches), nothing prefilled again"
    matches(ref, "after parking", ids, back, layers)
    ids += [t["token_id"] for t in back["generated_tokens"]]

    srv.stop()  # graceful: the slot is flushed to the store
    srv = start_server(*args)
    # the same tokens resent: the stored sliding cache holds exactly the window, which a cut by one keeps
    same = generate(srv.url, "a", ids)
    assert same["cached_tokens"] == len(ids) - 1, "the resumed state is used, not prefilled again"
    matches(ref, "resent after a restart", ids, same, layers)
    ids += [t["token_id"] for t in same["generated_tokens"]]
    ids.append(ids[9])
    again = generate(srv.url, "a", ids)
    assert again["cached_tokens"] == len(ids) - 1
    matches(ref, "after a restart", ids, again, layers)
    ids += [t["token_id"] for t in again["generated_tokens"]]

    saved = httpx.post(srv.url + "/slots/a?action=save-state", headers={"Accept": "application/octet-stream"})
    assert saved.status_code == 200, saved.text
    put = httpx.post(srv.url + "/slots/c?action=restore-state", content=saved.content,
                     headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    assert put.status_code == 200, put.text
    ids.append(ids[11])
    copy = generate(srv.url, "c", ids)
    assert copy["cached_tokens"] == len(ids) - 1
    matches(ref, "after save-state / restore-state", ids, copy, layers)


def test_recurrent_model_through_the_server(start_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    gguf = build_tiny_gguf("mamba", tmp_path / "mamba")
    ref = Reference(gguf.parent)
    srv = start_server(
        "--model", str(gguf), "--parallel", "2", "--ctx-size", "256", "--state-dir", str(tmp_path / "st")
    )
    info = httpx.get(srv.url + "/api/v1/model").json()
    assert info["memory"]["type"] == "recurrent" and info["attention_layers"] == []
    assert info["memory"]["context_shift"] is False and info["memory"]["partial_reuse"] is False
    ids = tokenize(srv.url, TEXT)
    refused = httpx.post(
        srv.url + "/api/v1/generate", json={"input_ids": ids, "return_attention": True, "id_slot": "m"}
    )
    assert refused.status_code == 400 and refused.json()["error_code"] == "INVALID_REQUEST", refused.text
    assert "no attention" in refused.text
    assert httpx.get(srv.url + "/slots").json() == [] or all(
        s["id"] != "m" for s in httpx.get(srv.url + "/slots").json()
    )
    out = generate(srv.url, "m", ids, attention=False)
    matches(ref, "mamba", ids, out, [])
    n = len(ids) + 3
    shift = httpx.post(srv.url + "/slots/m?action=context-shift", json={"n_keep": 2, "n_discard": 4})
    assert shift.status_code == 400 and "recurrent" in shift.text, shift.text
    tokens = httpx.post(srv.url + "/slots/m?action=tokens").json()
    assert tokens["n_tokens"] == n, "the refused shift changed nothing"
    # a prompt that diverges from the cached one is prefilled again from the start, and still exact
    diverged = [*ids[:5], ids[1]]
    out = generate(srv.url, "m", diverged, attention=False)
    assert out["cached_tokens"] == 0
    matches(ref, "mamba diverged", diverged, out, [])
