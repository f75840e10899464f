"""Generation over HTTP, SSE and both WebSockets against a real server and worker."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import decode_attention, sse_events, tokenize, ws_binary, ws_v1
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def ids(server: ServerProc) -> list[int]:
    return tokenize(server.url, CHAT.format("What is the capital of France?"))


def gen_body(ids: list[int], slot: str, **kw: object) -> dict[str, object]:
    return {"input_ids": ids, "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "id_slot": slot, **kw}


def check_rows(att: np.ndarray, n_ctx: int) -> None:
    assert att.shape == (30, 9, n_ctx)
    np.testing.assert_allclose(att.sum(axis=-1), 1.0, atol=1e-3)


def test_generate_non_streaming(server: ServerProc, ids: list[int]) -> None:
    r = httpx.post(server.url + "/api/v1/generate", json=gen_body(ids, "g1", return_attention=True), timeout=120)
    assert r.status_code == 200
    body = r.json()
    assert body["finish_reason"] == "length" and len(body["generated_tokens"]) == 8
    assert body["results"][0]["text"] == body["generated_text"]
    assert body["generated_text"] == "".join(t["text"] for t in body["generated_tokens"])
    assert len(body["attention_data"]) == 8
    for k, entry in enumerate(body["attention_data"]):
        assert entry["token_id"] == body["generated_tokens"][k]["token_id"]
        check_rows(decode_attention(entry["attention"]), len(ids) + k)


def test_all_wire_formats_agree(server: ServerProc, ids: list[int]) -> None:
    """Greedy: the same tokens and attention over JSON, SSE, binary WS and the v1 WS."""
    js = httpx.post(
        server.url + "/api/v1/generate", json=gen_body(ids, "w1", return_attention=True), timeout=120
    ).json()
    ref = [decode_attention(e["attention"]) for e in js["attention_data"]]
    tokens = [t["token_id"] for t in js["generated_tokens"]]

    sse = sse_events(server.url, gen_body(ids, "w2", output_attentions=True, request_id="req-7", max_length=8))
    toks = [e for e in sse if e["type"] == "token"]
    assert [e["token"]["token_id"] for e in toks] == tokens
    assert all(e["request_id"] == "req-7" for e in sse)
    assert sse[-1]["type"] == "done" and sse[-1]["total_tokens"] == 8
    for e, want in zip(toks, ref, strict=True):
        assert e["attention"]["format"] == "per_layer" and e["attention"]["context_length"] == want.shape[-1]
        np.testing.assert_allclose(decode_attention(e["attention"]), want, atol=1e-6)

    ws = ws_binary(server.ws_url, gen_body(ids, "w3", max_length=8))
    assert [t["token_id"] for t in ws.tokens] == tokens
    assert ws.done is not None and ws.done["finish_reason"] == "length" and ws.close_code == 1000
    for got, want in zip(ws.attention, ref, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)

    v1 = ws_v1(server.ws_url, [{"type": "generate", **gen_body(ids, "w4", return_attention=True)}])
    tev = [e for e in v1 if e["type"] == "token"]
    assert [e["token"]["token_id"] for e in tev] == tokens
    for e, want in zip(tev, ref, strict=True):
        assert e["token"]["logprob"] <= 0 and isinstance(e["token"]["top_logprobs"], list)
        np.testing.assert_allclose(decode_attention(e["attention"]), want, atol=1e-6)
    assert v1[-1]["type"] == "done" and v1[-1]["generation_time_ms"] > 0


def test_aggregated_and_float16(server: ServerProc, ids: list[int]) -> None:
    full = httpx.post(
        server.url + "/api/v1/generate", json=gen_body(ids, "a1", return_attention=True), timeout=120
    ).json()
    agg = sse_events(
        server.url,
        gen_body(ids, "a2", output_attentions=True, attention_format="aggregated", attention_dtype="float16"),
    )
    toks = [e for e in agg if e["type"] == "token"]
    for e, f in zip(toks, full["attention_data"], strict=True):
        a = e["attention"]
        assert a["format"] == "aggregated" and a["dtype"] == "float16"
        assert a["shape"] == [a["context_length"]]
        np.testing.assert_allclose(
            decode_attention(a).astype(np.float32), decode_attention(f["attention"]).mean(axis=(0, 1)), atol=1e-3
        )


def test_kobold_sse_without_attention(server: ServerProc) -> None:
    ev = sse_events(server.url, {"prompt": "The capital of France is", "max_length": 5, "temperature": 0, "rep_pen": 1.1,
                                 "sampler_seed": -1, "stop_sequence": ["<|im_start|>user"], "id_slot": "k1"})  # fmt: skip
    assert all(set(e) == {"token", "finish_reason"} for e in ev)
    assert ev[-1]["finish_reason"] == "length" and all(e["finish_reason"] is None for e in ev[:-1])
    assert "".join(e["token"] for e in ev).strip()


def test_hidden_states(server: ServerProc, ids: list[int]) -> None:
    ev = sse_events(
        server.url, gen_body(ids, "h1", output_attentions=True, output_hidden_states=True, max_new_tokens=3)
    )
    hs = [e["hidden_state"] for e in ev if e["type"] == "token"]
    assert len(hs) == 3 and all(h["shape"] == [576] and h["dtype"] == "float32" for h in hs)


def test_stop_string_from_kobold_stop_sequence(server: ServerProc, ids: list[int]) -> None:
    first = httpx.post(server.url + "/api/v1/generate", json=gen_body(ids, "s1", max_new_tokens=12), timeout=60).json()
    text = first["generated_text"]
    needle = text[3:7]
    r = httpx.post(
        server.url + "/api/v1/generate", json=gen_body(ids, "s1", max_new_tokens=12, stop_sequence=[needle]), timeout=60
    )
    body = r.json()
    assert body["finish_reason"] == "stop_string" and body["stop_string"] == needle
    assert needle in body["generated_text"]


def test_prefix_reuse_without_a_slot_id(server: ServerProc, ids: list[int]) -> None:
    """A request without a slot gets an anonymous one (named in X-Slot-Id); a follow-up that
    extends the context finds that slot again and reuses its KV."""
    body = {"input_ids": ids, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/api/v1/generate", json=body, timeout=60)
    first = r.json()
    assert str(first["slot_id"]).startswith("anon-") and r.headers["x-slot-id"] == first["slot_id"]
    follow = ids + [t["token_id"] for t in first["generated_tokens"]] + tokenize(server.url, "\nThanks!")
    second = httpx.post(server.url + "/api/v1/generate", json={**body, "input_ids": follow}, timeout=60).json()
    assert second["slot_id"] == first["slot_id"]
    assert second["cached_tokens"] == len(ids) + 6
    assert second["prompt_tokens"] == len(follow)


BAD = [
    ({"input_ids": [1, 2, 49152]}, 400, "INVALID_TOKEN"),
    ({"input_ids": [-3]}, 400, "INVALID_TOKEN"),
    ({"input_ids": [1, 2], "banned_tokens": [999999]}, 400, "INVALID_TOKEN"),
    ({"input_ids": [1, 2], "stop_tokens": [-1]}, 400, "INVALID_TOKEN"),
    ({"input_ids": list(range(100, 2000)), "max_new_tokens": 200}, 400, "CONTEXT_OVERFLOW"),
    ({"input_ids": "hello"}, 400, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "temperature": "hot"}, 400, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "max_new_tokens": -1}, 400, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "attention_format": "sparse"}, 400, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "attention_layers": [30]}, 400, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "top_p": 2}, 400, "INVALID_REQUEST"),
    ({"input_ids": []}, 400, "INVALID_REQUEST"),
    ({}, 400, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "id_slot": "x" * 300}, 400, "INVALID_REQUEST"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD)
def test_bad_generate_requests(server: ServerProc, body: dict[str, object], status: int, code: str) -> None:
    for path in ("/api/v1/generate", "/api/extra/generate/stream"):
        r = httpx.post(server.url + path, json={"id_slot": "bad", **body}, timeout=60)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error_code"] == code, (path, r.text)


def test_bad_input_over_websockets(server: ServerProc, ids: list[int]) -> None:
    ws = ws_binary(server.ws_url, {"input_ids": [1, 10**9]})
    assert ws.error is not None and ws.error["error_code"] == "INVALID_TOKEN" and not ws.tokens
    ws = ws_binary(server.ws_url, "{not json")
    assert ws.error is not None and ws.error["error_code"] == "INVALID_REQUEST"
    # the JSON WebSocket: an error event, and the same socket serves the next request
    ev = ws_v1(
        server.ws_url,
        [
            '{"type": "generate", "input_ids": [1, 2], "max_new_tokens": "ten"}',
            {"type": "generate", **gen_body(ids, "e1")},
        ],
        until_done=2,
    )
    assert ev[0]["type"] == "error" and ev[0]["error_code"] == "INVALID_REQUEST"
    assert ev[-1]["type"] == "done"


def test_oversized_bodies_and_messages(server: ServerProc) -> None:
    big = {"input_ids": [5] * 10, "prompt": "x" * (5 << 20)}  # the test server's limit is 4 MiB
    r = httpx.post(server.url + "/api/v1/generate", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error_code"] == "PAYLOAD_TOO_LARGE"
    ws = ws_binary(server.ws_url, big)
    assert ws.error is not None and ws.error["error_code"] == "PAYLOAD_TOO_LARGE"


def test_cancel_message_stops_generation(server: ServerProc, ids: list[int]) -> None:
    with connect(server.ws_url + "/api/v1/generate/stream", max_size=None) as ws:
        ws.send(json.dumps({"type": "generate", **gen_body(ids, "c1", max_new_tokens=1000, return_attention=False)}))
        first = json.loads(ws.recv(timeout=60))
        assert first["type"] == "token"
        ws.send('{"type": "cancel"}')
        n = 1
        while True:
            ev = json.loads(ws.recv(timeout=30))
            if ev["type"] == "done":
                break
            n += 1
        assert ev["finish_reason"] == "cancelled"
        assert n < 50


def slot_listing(server: ServerProc) -> dict[str, dict]:  # type: ignore[type-arg]
    return {s["id"]: s for s in httpx.get(server.url + "/slots").json()}


def processing(server: ServerProc, slot: str) -> bool:
    """Whether ``slot`` exists and serves a request now (``GET /slots``' ``is_processing``)."""
    return bool(slot_listing(server).get(slot, {}).get("is_processing"))


def _slot_free(server: ServerProc, slot: str, ids: list[int]) -> bool:
    r = httpx.post(server.url + "/api/v1/generate", json=gen_body(ids, slot, max_new_tokens=1), timeout=60)
    return r.status_code == 200


def test_client_disconnect_cancels(server: ServerProc, ids: list[int]) -> None:
    # binary WS: read two tokens, then vanish
    with connect(server.ws_url + "/api/extra/generate/stream/ws", max_size=None) as ws:
        ws.send(json.dumps(gen_body(ids, "d1", max_length=2000, max_new_tokens=1500)))
        for _ in range(4):
            ws.recv(timeout=60)
    # SSE: read a few events, then close the connection
    with httpx.stream("POST", server.url + "/api/extra/generate/stream", json=gen_body(ids, "d2", max_new_tokens=1500),
                      timeout=60) as r:  # fmt: skip
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    wait_until(lambda: not processing(server, "d1") and not processing(server, "d2"), "both generations stop")
    assert slot_listing(server)["d1"]["n_tokens"] < len(ids) + 200  # stopped long before 1500 tokens
    assert _slot_free(server, "d1", ids) and _slot_free(server, "d2", ids)


def test_concurrent_requests_on_one_slot(server: ServerProc, ids: list[int]) -> None:
    results: list[httpx.Response] = []

    def call() -> None:
        results.append(
            httpx.post(server.url + "/api/v1/generate", json=gen_body(ids, "busy", max_new_tokens=60), timeout=120)
        )

    threads = [threading.Thread(target=call) for _ in range(2)]
    threads[0].start()
    wait_until(lambda: processing(server, "busy") or results, "the first request runs")
    threads[1].start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 409], [r.text[:200] for r in results]
    busy = next(r for r in results if r.status_code == 409).json()
    assert busy["error_code"] == "SLOT_BUSY"
    # with "wait": true the second request queues instead
    waited: list[httpx.Response] = []
    t = threading.Thread(target=lambda: waited.append(httpx.post(server.url + "/api/v1/generate",
                                                                 json=gen_body(ids, "busy", max_new_tokens=40), timeout=120)))  # fmt: skip
    t.start()
    wait_until(lambda: processing(server, "busy") or waited, "the request that does not wait runs")
    r2 = httpx.post(
        server.url + "/api/v1/generate", json=gen_body(ids, "busy", max_new_tokens=4, wait=True), timeout=120
    )
    t.join()
    assert waited[0].status_code == 200 and r2.status_code == 200


def test_server_still_serves_after_bad_input(server: ServerProc, ids: list[int]) -> None:
    r = httpx.post(server.url + "/api/v1/generate", json=gen_body(ids, "after"), timeout=60)
    assert r.status_code == 200 and len(r.json()["generated_tokens"]) == 8
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_pipelined_requests_on_one_socket_are_all_served(server: ServerProc, ids: list[int]) -> None:
    """Messages that arrive while a generation runs are kept for the next request, not lost."""
    msgs = [{"type": "generate", **gen_body(ids, "pipe", max_new_tokens=1, request_id=f"r{i}")} for i in range(5)]
    ev = ws_v1(server.ws_url, msgs, until_done=5)
    done = [e for e in ev if e["type"] == "done"]
    assert [d["request_id"] for d in done] == ["r0", "r1", "r2", "r3", "r4"]


def test_non_streaming_extras_and_disconnect(server: ServerProc, ids: list[int]) -> None:
    body = gen_body(ids, "x1", max_new_tokens=3, n_probs=3, output_hidden_states=True)
    out = httpx.post(server.url + "/api/v1/generate", json=body, timeout=60).json()
    for t in out["generated_tokens"]:
        assert len(t["top_logprobs"]) == 3 and t["top_logprobs"][0]["token_id"] == t["token_id"]
        assert t["hidden_state"]["shape"] == [576]
    # a client that gives up: the generation stops instead of running to 1500 tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/api/v1/generate", json=gen_body(ids, "x2", max_new_tokens=1500), timeout=2)
    wait_until(lambda: not processing(server, "x2"), "the generation of the client that left stops")
    toks = httpx.post(server.url + "/slots/x2", params={"action": "tokens"}).json()["n_tokens"]
    assert toks < len(ids) + 1000
