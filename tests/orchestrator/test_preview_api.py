"""Preview (docs/api.md, "POST /api/v1/generate/preview"): generation on a copy-on-write fork; the slot stays exactly as it was."""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import assert_same_greedy, decode_attention, tokenize


def gen(server: ServerProc, slot: str, ids: list[int], n: int = 8, wait: bool = False) -> dict:  # type: ignore[type-arg]
    body = {"input_ids": ids, "max_new_tokens": n, "temperature": 0, "ignore_eos": True, "id_slot": slot,
            "return_attention": True, "n_probs": 5, "wait": wait}  # fmt: skip
    r = httpx.post(server.url + "/api/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def preview(server: ServerProc, **body: object) -> httpx.Response:
    body.setdefault("temperature", 0)
    return httpx.post(server.url + "/api/v1/generate/preview", json=body, timeout=120)


def state(server: ServerProc, slot: str) -> tuple[list[int], bytes]:
    toks = httpx.post(f"{server.url}/slots/{slot}", params={"action": "tokens"}, timeout=60).json()["tokens"]
    blob = httpx.post(
        f"{server.url}/slots/{slot}",
        params={"action": "save-state"},
        headers={"Accept": "application/octet-stream"},
        timeout=60,
    ).content
    return toks, blob


@pytest.fixture(scope="module")
def turn(server: ServerProc) -> tuple[list[int], list[dict[str, object]]]:
    ids = tokenize(server.url, CHAT.format("Tell me about owls."))
    user = tokenize(
        server.url, "<|im_end|>\n<|im_start|>user\nAnd what do they eat?<|im_end|>\n<|im_start|>assistant\n"
    )
    pieces = httpx.post(server.url + "/api/v1/tokenize", json={"text": "<|im_end|>\n<|im_start|>user\nAnd what do they eat?<|im_end|>\n<|im_start|>assistant\n"}).json()["tokens"]  # fmt: skip
    assert [p["token_id"] for p in pieces] == user
    return ids, pieces


def test_preview_leaves_the_slot_exactly_as_it_was(server: ServerProc, turn) -> None:  # type: ignore[no-untyped-def]
    ids, append = turn
    gen(server, "pv", ids)
    # control: a copy-on-write fork of the same state that never sees a preview
    httpx.post(f"{server.url}/slots/pv", params={"action": "fork"}, json={"target": "pv-control"}).raise_for_status()
    before = state(server, "pv")
    assert before[0] == state(server, "pv-control")[0]  # (the blobs name their own sequence ids)
    r = preview(server, append_tokens=append, max_tokens=20, conversation_id="pv")
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["cache_hit"] is True
    assert p["n_prefilled"] == len(append)
    assert p["token_count"] == len(p["tokens"]) > 0
    assert p["stopped_reason"] in ("max_tokens", "stop_token")
    assert p["generation_time_ms"] > 0 and isinstance(p["text"], str)
    assert state(server, "pv") == before, "tokens and KV state bytes unchanged"
    follow = before[0] + [t["token_id"] for t in append]
    a, c = gen(server, "pv", follow), gen(server, "pv-control", follow)
    assert a["cached_tokens"] == c["cached_tokens"] == len(before[0])
    n_same = assert_same_greedy(c, a)
    # the preview continued from the same context, so greedy says the same as the real turn
    as_preview = {"generated_tokens": [{"token_id": t["token_id"]} for t in p["tokens"]]}
    assert_same_greedy(
        a, as_preview | {"generated_tokens": as_preview["generated_tokens"][: len(a["generated_tokens"])]}
    )
    for x, y in list(zip(a["attention_data"], c["attention_data"], strict=True))[:n_same]:
        ax, ay = decode_attention(x["attention"]), decode_attention(y["attention"])
        assert ax.shape == ay.shape
        assert np.abs(ax[0] - ay[0]).max() < 1e-5 and np.abs(ax - ay).mean() < 2e-3


def test_plain_id_lists_and_attention(server: ServerProc, turn) -> None:  # type: ignore[no-untyped-def]
    ids, append = turn
    gen(server, "pv2", ids)
    n = len(state(server, "pv2")[0])
    plain = [t["token_id"] for t in append]
    p = preview(server, append_tokens=plain, max_tokens=4, id_slot="pv2", output_attentions=True).json()
    assert p["cache_hit"] and p["n_prefilled"] == len(plain)
    assert p["token_count"] == 4 or p["stopped_reason"] == "stop_token"
    for k, e in enumerate(p["attention_data"]):
        att = np.frombuffer(base64.b64decode(e["attention"]["data"]), dtype=np.float32).reshape(e["attention"]["shape"])
        assert att.shape == (30, 9, n + len(plain) + k)
        np.testing.assert_allclose(att.sum(-1), 1, atol=1e-3)


def test_two_previews_at_once(server: ServerProc, turn) -> None:  # type: ignore[no-untyped-def]
    ids, append = turn
    gen(server, "pv3", ids)
    before = state(server, "pv3")
    out: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda: out.append(preview(server, append_tokens=append, max_tokens=30, id_slot="pv3")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in out] == [200, 200], [r.text for r in out]
    a, b = (r.json() for r in out)
    assert a["cache_hit"] and b["cache_hit"]
    assert state(server, "pv3") == before
    # both say what the real turn says, up to a near-tie (the forks sit on different cells)
    real = gen(server, "pv3", before[0] + [t["token_id"] for t in append], n=30)
    for p in (a, b):
        n = len(p["tokens"])
        assert n > 0
        as_gen = {"generated_tokens": [{"token_id": t["token_id"]} for t in p["tokens"]]}
        assert_same_greedy({"generated_tokens": real["generated_tokens"][:n]}, as_gen)


def test_generation_beside_a_preview(server: ServerProc, turn) -> None:  # type: ignore[no-untyped-def]
    """A generation on the slot while its preview runs: neither sees the other's tokens."""
    ids, append = turn
    gen(server, "pv4", ids)
    toks, _ = state(server, "pv4")
    follow = toks + [t["token_id"] for t in append]
    gen(server, "pv4-control", ids)
    control = gen(server, "pv4-control", follow, n=12)
    res: dict[str, dict] = {}  # type: ignore[type-arg]
    tp = threading.Thread(
        target=lambda: res.setdefault(
            "p", preview(server, append_tokens=append, max_tokens=60, id_slot="pv4", output_attentions=True).json()
        )
    )
    tp.start()
    # the preview holds the slot while it forks it: the generation waits for that step, not the preview
    res["g"] = gen(server, "pv4", follow, n=12, wait=True)
    tp.join()
    assert_same_greedy(control, res["g"])
    # a cell of the other sequence in either mask would take attention mass that the
    # gather through the sequence's own cells does not see: every row sums to 1
    for e in res["g"]["attention_data"]:
        np.testing.assert_allclose(decode_attention(e["attention"]).sum(-1), 1, atol=1e-3)
    for e in res["p"]["attention_data"]:
        np.testing.assert_allclose(decode_attention(e["attention"]).sum(-1), 1, atol=1e-3)
    assert res["p"]["cache_hit"] is True
    assert state(server, "pv4")[0] == follow + [t["token_id"] for t in res["g"]["generated_tokens"]]


def test_no_cached_context(server: ServerProc, turn) -> None:  # type: ignore[no-untyped-def]
    ids, append = turn
    # a preview naming no slot forks the slot of the latest generation that named none: empty it
    g = httpx.post(server.url + "/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 1}, timeout=120)
    httpx.post(f"{server.url}/slots/{g.headers['x-slot-id']}", params={"action": "erase"}).raise_for_status()
    r = preview(server, append_tokens=append)
    assert r.status_code == 400
    assert r.json() == {"error": "No cached context available", "error_code": "NO_CACHED_CONTEXT"}
    r = preview(server, append_tokens=append, input_ids=ids, max_tokens=5)
    assert r.status_code == 200 and r.json()["cache_hit"] is False
    assert r.json()["n_prefilled"] == len(ids) + len(append)
    r = preview(server, append_tokens=append, input_ids=ids, max_tokens=5, use_cached_context=False, id_slot="pv")
    assert r.status_code == 200 and r.json()["cache_hit"] is False


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"max_tokens": 257}, 400, "INVALID_REQUEST"),
        ({"max_tokens": 0}, 400, "INVALID_REQUEST"),
        ({"append_tokens": [{"token_id": 49152, "text": "x"}]}, 400, "INVALID_TOKEN"),
        ({"append_tokens": [-1]}, 400, "INVALID_TOKEN"),
        ({"append_tokens": "abc"}, 400, "INVALID_REQUEST"),
        ({"temperature": "warm"}, 400, "INVALID_REQUEST"),
        ({"top_p": 3}, 400, "INVALID_REQUEST"),
        ({"conversation_id": "no-such-slot"}, 404, "SLOT_NOT_FOUND"),
        ({"stop_tokens": [10**9]}, 400, "INVALID_TOKEN"),
    ],
)
def test_bad_previews_leave_the_slot_alone(server: ServerProc, turn, body, status: int, code: str) -> None:  # type: ignore[no-untyped-def]
    ids, append = turn
    gen(server, "pv5", ids, n=2)
    before = state(server, "pv5")
    full = {"append_tokens": append, "id_slot": "pv5", **body}
    r = preview(server, **full)
    assert r.status_code == status and r.json()["error_code"] == code, r.text
    assert state(server, "pv5") == before
