"""llama-server's slot API (docs/api.md, "Slots") on slotserve: every action, both content types, bad input."""

from __future__ import annotations

import base64
import struct

import httpx
import numpy as np
import pytest

from tests.conftest import CHAT, ServerProc
from tests.engine.enginekit import assert_attention_close
from tests.orchestrator.client import assert_same_greedy, decode_attention, tokenize
from tests.waiting import wait_until


def gen(server: ServerProc, slot: str, ids: list[int], n: int = 6, **kw: object) -> dict:  # type: ignore[type-arg]
    body = {"input_ids": ids, "max_new_tokens": n, "temperature": 0, "ignore_eos": True, "id_slot": slot,
            "return_attention": True, "n_probs": 5, **kw}  # fmt: skip
    r = httpx.post(server.url + "/api/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def action(server: ServerProc, slot: str, name: str, **kw: object) -> httpx.Response:
    return httpx.post(f"{server.url}/slots/{slot}", params={"action": name}, timeout=120, **kw)  # type: ignore[arg-type]


def tokens_of(server: ServerProc, slot: str) -> list[int]:
    r = action(server, slot, "tokens")
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def convo(server: ServerProc) -> list[int]:
    return tokenize(server.url, CHAT.format("Give me one word for happy."))


def test_tokens_and_listing(server: ServerProc, convo: list[int]) -> None:
    out = gen(server, "7", convo)
    r = action(server, "7", "tokens").json()
    assert r["id_slot"] == 7  # numeric ids come back as numbers, like llama-server's
    assert r["n_tokens"] == len(convo) + 6 == len(r["tokens"])
    assert r["tokens"] == convo + [t["token_id"] for t in out["generated_tokens"]]
    assert r["n_prompt_tokens_processed"] > 0
    slots = {s["id"]: s for s in httpx.get(server.url + "/slots").json()}
    s7 = slots[7]
    assert s7["n_ctx"] == 2048 and s7["is_processing"] is False and s7["n_tokens"] == len(convo) + 6
    assert s7["place"] == "resident"


def test_info_message_boundaries(server: ServerProc) -> None:
    ids = tokenize(
        server.url, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    gen(server, "info", ids, n=3)
    info = httpx.get(server.url + "/v1/slots/info/info").json()
    toks = tokens_of(server, "info")
    assert info["boundary_eot"] == 2 and info["n_tokens"] == len(toks)
    msgs = info["messages"]
    assert info["n_messages"] == len(msgs) == 3
    assert msgs[0]["start"] == 0 and toks[msgs[0]["end"]] == 2 and toks[msgs[1]["end"]] == 2
    assert msgs[1]["start"] == msgs[0]["end"] + 1 and msgs[2]["start"] == msgs[1]["end"] + 1
    assert msgs[2]["end"] == len(toks) - 1
    assert [m["index"] for m in msgs] == [0, 1, 2]


def test_save_state_both_content_types(server: ServerProc, convo: list[int]) -> None:
    gen(server, "s-a", convo)
    js = action(server, "s-a", "save-state").json()
    raw = action(server, "s-a", "save-state", headers={"Accept": "application/octet-stream"})
    assert raw.headers["content-type"].startswith("application/octet-stream")
    blob = base64.b64decode(js["state"])
    assert blob == raw.content
    assert js["n_bytes"] == len(blob) and js["n_tokens"] == len(convo) + 6 and js["t_ms"] >= 0
    magic, n = struct.unpack_from("<4sI", blob)
    assert magic == b"SES1" and n == js["n_tokens"]
    assert list(np.frombuffer(blob, dtype="<i4", count=n, offset=8)) == tokens_of(server, "s-a")


def test_save_state_json_of_a_resident_slot_in_a_pooled_buffer(server: ServerProc, convo: list[int]) -> None:
    """A state of 1 MiB or more arrives in a buffer of the engine client's receive pool; the JSON
    answer was a 500 (the buffer handed back before its size was read).  Now the state is lent
    for the answer and its sizes taken when lent."""
    ids = convo * 3  # about 100 tokens: 2 MB of KV state
    gen(server, "s-pooled", ids, n=4)
    for _ in range(2):  # the second reads into the buffer the first gave back
        r = action(server, "s-pooled", "save-state")
        assert r.status_code == 200, r.text
        js = r.json()
        blob = base64.b64decode(js["state"])
        assert js["n_bytes"] == len(blob) >= 1 << 20 and js["n_tokens"] == len(ids) + 4


def test_round_trip_gives_identical_generations(server: ServerProc, convo: list[int]) -> None:
    """save-state from A, restore-state into B (JSON and raw), then greedy from A and B agree."""
    gen(server, "rt-a", convo)
    blob = action(server, "rt-a", "save-state", headers={"Accept": "application/octet-stream"}).content
    r = action(server, "rt-b", "restore-state", content=blob, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert r.json() == {"id_slot": "rt-b", "n_bytes_read": len(blob), "success": True, "t_ms": r.json()["t_ms"]}
    r = action(server, "rt-c", "restore-state", json={"state": base64.b64encode(blob).decode()})
    assert r.status_code == 200 and r.json()["success"] is True
    toks = tokens_of(server, "rt-a")
    assert tokens_of(server, "rt-b") == toks == tokens_of(server, "rt-c")
    follow = toks + tokenize(server.url, "\nAnother one?")
    outs = [gen(server, s, follow, n=8) for s in ("rt-a", "rt-b", "rt-c")]
    for o in outs:
        assert o["cached_tokens"] == len(toks), "restored slots reuse their KV, no re-prefill"
    n_same = min(assert_same_greedy(outs[0], o) for o in outs[1:])
    for k in range(n_same):
        a = decode_attention(outs[0]["attention_data"][k]["attention"])
        for o in outs[1:]:
            assert_attention_close(decode_attention(o["attention_data"][k]["attention"]), a, f"token {k}")


def test_file_save_erase_restore(server: ServerProc, convo: list[int]) -> None:
    gen(server, "f1", convo)
    before = tokens_of(server, "f1")
    r = action(server, "f1", "save", json={"filename": "f1.ses1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["filename"] == "f1.ses1" and body["n_saved"] == len(before) and body["n_written"] > 0
    e = action(server, "f1", "erase").json()
    assert e == {"id_slot": "f1", "n_erased": len(before)}
    assert action(server, "f1", "tokens").status_code == 404  # gone
    r = action(server, "f1", "restore", json={"filename": "f1.ses1"})
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == len(before) and r.json()["n_read"] == body["n_written"]
    assert tokens_of(server, "f1") == before
    out = gen(server, "f1", before + tokenize(server.url, " ok"), n=2)
    assert out["cached_tokens"] == len(before)


@pytest.mark.parametrize("name", ["../escape.ses1", "/etc/passwd", "a/b.ses1", "..", "", "x\\y"])
def test_file_actions_refuse_path_escapes(server: ServerProc, convo: list[int], name: str) -> None:
    gen(server, "f2", convo, n=1)
    for act in ("save", "restore"):
        r = action(server, "f2", act, json={"filename": name})
        assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST", (act, name, r.text)


def test_context_shift(server: ServerProc) -> None:
    ids = tokenize(
        server.url,
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        + "<|im_start|>user\nHello there, how are you today?<|im_end|>\n" * 3,
    )
    gen(server, "cs", ids, n=4)
    toks = tokens_of(server, "cs")
    r = action(server, "cs", "context-shift", json={"n_keep": 10, "n_discard": 20})
    assert r.status_code == 200, r.text
    assert r.json() == {"id_slot": "cs", "success": True, "new_n_tokens": len(toks) - 20}
    kept = toks[:10] + toks[30:]
    assert tokens_of(server, "cs") == kept
    out = gen(server, "cs", kept, n=3)
    assert out["cached_tokens"] == len(kept) - 1
    for k, e in enumerate(out["attention_data"]):
        att = decode_attention(e["attention"])
        assert att.shape == (30, 9, len(kept) + k)  # indexed by the slot's new positions
        np.testing.assert_allclose(att.sum(-1), 1, atol=1e-3)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"n_keep": -1, "n_discard": 5}, "n_keep < 0"),
        ({"n_keep": 0, "n_discard": 0}, "n_discard = 0"),
        ({"n_keep": 5, "n_discard": 100_000}, "beyond n_tokens"),
        ({"n_keep": "a", "n_discard": 1}, "wrong type"),
        ({"n_discard": 1}, "missing field"),
    ],
)
def test_context_shift_constraints(server: ServerProc, convo: list[int], body: dict, why: str) -> None:  # type: ignore[type-arg]
    gen(server, "cs2", convo, n=2)
    before = tokens_of(server, "cs2")
    r = action(server, "cs2", "context-shift", json=body)
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST", (why, r.text)
    assert tokens_of(server, "cs2") == before


def test_fork(server: ServerProc, convo: list[int]) -> None:
    gen(server, "fk", convo)
    toks = tokens_of(server, "fk")
    r = action(server, "fk", "fork", json={"target": "fk-child"})
    assert r.status_code == 200, r.text
    assert r.json() == {"id_slot": "fk", "target": "fk-child", "n_tokens": len(toks), "success": True}
    assert tokens_of(server, "fk-child") == toks
    follow = toks + tokenize(server.url, "\nMore?")
    a, b = gen(server, "fk", follow, n=5), gen(server, "fk-child", follow, n=5)
    assert a["cached_tokens"] == b["cached_tokens"] == len(toks)
    assert_same_greedy(a, b)
    # the branches are independent now
    gen(server, "fk-child", follow + tokenize(server.url, " branch"), n=3)
    assert tokens_of(server, "fk")[: len(follow)] == follow


def bad_blobs(good: bytes) -> dict[str, bytes]:
    n = struct.unpack_from("<I", good, 4)[0]
    vocab = bytearray(good)
    struct.pack_into("<i", vocab, 8, 10**7)
    foreign = bytearray(good)
    state_off = 8 + 4 * n
    struct.pack_into("<I", foreign, state_off + 8 + 4 + 12 * n + 4, 24)  # a 24-layer model's state
    state_trunc = good[: state_off + 100]
    return {
        "magic": b"XXXX" + good[4:],
        "truncated-header": good[:6],
        "truncated-tokens": good[: 8 + 4 * (n - 1)],
        "truncated-state": state_trunc,
        "vocab": bytes(vocab),
        "foreign-model": bytes(foreign),
        "garbage": b"SES1" + struct.pack("<I", 2) + b"\x01\x00\x00\x00\x02\x00\x00\x00" + b"\x00" * 64,
        "empty": b"",
    }


def test_bad_state_blobs_leave_slots_alone(server: ServerProc, convo: list[int]) -> None:
    gen(server, "bs", convo)
    good = action(server, "bs", "save-state", headers={"Accept": "application/octet-stream"}).content
    before = tokens_of(server, "bs")
    for name, blob in bad_blobs(good).items():
        r = action(server, "bs", "restore-state", content=blob, headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and r.json()["error_code"] == "BAD_STATE", (name, r.text)
        assert tokens_of(server, "bs") == before, name
        r = action(
            server, "bs-new", "restore-state", content=blob, headers={"Content-Type": "application/octet-stream"}
        )
        assert r.status_code == 400, name
        assert action(server, "bs-new", "tokens").status_code == 404, (
            f"{name}: a refused restore must not create the slot"
        )
    r = action(server, "bs", "restore-state", json={"state": "not base64!!"})
    assert r.status_code == 400 and r.json()["error_code"] == "BAD_STATE"
    r = action(server, "bs", "restore-state", content=b"{bad json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"
    assert action(server, "bs", "save-state", headers={"Accept": "application/octet-stream"}).content == good
    out = gen(server, "bs", before + tokenize(server.url, " yes"), n=2)
    assert out["cached_tokens"] == len(before)


def test_unknown_slot_and_action(server: ServerProc) -> None:
    for act in ("tokens", "save-state", "context-shift", "erase", "save"):
        r = action(server, "nope-404", act, json={"n_keep": 0, "n_discard": 1, "filename": "x"})
        assert r.status_code == 404 and r.json()["error_code"] == "SLOT_NOT_FOUND", act
    r = httpx.get(server.url + "/v1/slots/nope-404/info")
    assert r.status_code == 404
    r = action(server, "0", "frobnicate")
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"
    r = httpx.post(server.url + "/slots/0")  # no action
    assert r.status_code == 400


def test_busy_slot(server: ServerProc, convo: list[int]) -> None:
    import threading

    done: list[dict] = []  # type: ignore[type-arg]
    t = threading.Thread(target=lambda: done.append(gen(server, "busy-slot", convo, n=80, return_attention=False)))
    t.start()

    def running() -> bool:
        listing = {s["id"]: s for s in httpx.get(server.url + "/slots").json()}
        return bool(listing.get("busy-slot", {}).get("is_processing"))

    wait_until(running, "the generation on busy-slot runs")
    r = action(server, "busy-slot", "save-state")
    t.join()
    assert r.status_code == 409 and r.json()["error_code"] == "SLOT_BUSY"
    assert done and len(done[0]["generated_tokens"]) == 80


def test_four_conversations_at_once_match_running_alone(server: ServerProc) -> None:
    """--parallel 4: four slots decode in the same batches and each gets its solo result."""
    import threading

    prompts = [tokenize(server.url, CHAT.format(q)) for q in ("Hi!", "Count to five.", "What is 2+2?", "Name a fruit.")]
    alone = [gen(server, f"solo-{i}", p, n=10) for i, p in enumerate(prompts)]
    together: dict[int, dict] = {}  # type: ignore[type-arg]
    threads = [
        threading.Thread(target=lambda i=i, p=p: together.__setitem__(i, gen(server, f"par-{i}", p, n=10)))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for k in range(assert_same_greedy(alone[i], together[i])):
            assert_attention_close(
                decode_attention(together[i]["attention_data"][k]["attention"]),
                decode_attention(alone[i]["attention_data"][k]["attention"]),
                f"slot {i} token {k}",
            )
