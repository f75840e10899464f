"""Prompts longer than ``--batch-size`` through every API at once, against a real server and worker.

The server runs with ``--batch-size 64``: a 115-token prompt is prefilled in several decodes, and five such
prompts sent together (llama-server's ``/completion``, ``/v1/chat/completions``, ``/api/v1/generate``, the
KoboldCpp SSE stream and the binary WebSocket) share each decode's 64 tokens.  Each answer is the one a
request alone gets (greedy tokens, attention rows over every prompt position); a prompt longer than the
context is refused by each with a 4xx and ``CONTEXT_OVERFLOW``, and the server answers on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import CHAT, ServerProc
from tests.engine.enginekit import assert_attention_close
from tests.orchestrator.client import assert_same_greedy, decode_attention, sse_events, tokenize, ws_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # on a loaded 2-core machine prefill fell to 2 tokens/s

N_BATCH = 64
N_NEW = 4
TEXT = (
    "Summarise this story. A fox crossed the river at dawn, met a heron on the far bank and asked the way to "
    "the old mill; the heron pointed upstream, past three willows and a broken fence, and warned of the dog. "
)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("long-prompts")
    args = ["--threads", "2", "--verify-cells", "--parallel", "6", "--ctx-size", "512",
            "--batch-size", str(N_BATCH), "--ubatch-size", str(N_BATCH)]  # fmt: skip
    s = ServerProc(args, work).start()
    yield s
    s.stop()


def body(ids: list[int], slot: str, **kw: object) -> dict[str, Any]:
    return {"input_ids": ids, "max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True, "id_slot": slot, **kw}


def check_rows(rows: list[np.ndarray], ref: list[np.ndarray], n_prompt: int, agreed: int, what: str) -> None:
    """Rows over every position of the prompt and the tokens before; equal to the lone request's where
    the tokens agreed (another batch composition rounds differently: tests/engine/enginekit.py)."""
    assert len(rows) == N_NEW, what
    for k, att in enumerate(rows):
        assert att.shape == (30, 9, n_prompt + k), (what, k, att.shape)
        np.testing.assert_allclose(att.sum(axis=-1), 1.0, atol=1e-3, err_msg=what)
    for k in range(agreed):
        assert_attention_close(rows[k], ref[k], f"{what} token {k}")


def test_prompts_longer_than_a_batch_through_every_api_at_once(srv: ServerProc) -> None:
    ids = tokenize(srv.url, CHAT.format(TEXT * 2))
    assert N_BATCH < len(ids) < 300
    alone = httpx.post(srv.url + "/api/v1/generate", json=body(ids, "alone", return_attention=True, n_probs=5),
                       timeout=600).json()  # fmt: skip
    ref = [decode_attention(e["attention"]) for e in alone["attention_data"]]
    assert alone["cached_tokens"] == 0 and len(ref) == N_NEW

    out: dict[str, Any] = {}

    def completion() -> Any:
        req = {"prompt": ids, "n_predict": N_NEW, "temperature": 0, "ignore_eos": True, "id_slot": 11,
               "return_tokens": True}  # fmt: skip
        return httpx.post(srv.url + "/completion", json=req, timeout=600)

    def chat() -> Any:
        req = {"messages": [{"role": "user", "content": TEXT * 2}], "max_tokens": N_NEW, "temperature": 0}
        return httpx.post(srv.url + "/v1/chat/completions", json=req, timeout=600)

    calls: dict[str, Callable[[], Any]] = {
        "completion": completion,
        "chat": chat,
        "generate": lambda: httpx.post(
            srv.url + "/api/v1/generate", json=body(ids, "g", return_attention=True), timeout=600
        ),
        "sse": lambda: sse_events(srv.url, body(ids, "s", output_attentions=True, max_length=N_NEW), timeout=600),
        "ws": lambda: ws_binary(srv.ws_url, body(ids, "w", max_length=N_NEW)),
    }

    def run(name: str) -> None:
        out[name] = calls[name]()

    threads = [threading.Thread(target=run, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert sorted(out) == sorted(calls), "a request did not finish"

    comp = out["completion"]
    assert comp.status_code == 200, comp.text
    c = comp.json()
    assert c["timings"]["prompt_n"] == len(ids) and c["tokens_evaluated"] == len(ids) and c["timings"]["cache_n"] == 0
    assert_same_greedy(alone, {"generated_tokens": [{"token_id": t} for t in c["tokens"]]})

    ch = out["chat"]
    assert ch.status_code == 200, ch.text
    usage = ch.json()["usage"]
    assert usage["prompt_tokens"] > N_BATCH and usage["completion_tokens"] == N_NEW
    assert ch.json()["choices"][0]["finish_reason"] == "length"

    gen = out["generate"]
    assert gen.status_code == 200, gen.text
    g = gen.json()
    assert g["cached_tokens"] == 0
    agreed = assert_same_greedy(alone, g)
    check_rows([decode_attention(e["attention"]) for e in g["attention_data"]], ref, len(ids), agreed, "generate")

    toks = [e for e in out["sse"] if e["type"] == "token"]
    assert out["sse"][-1]["type"] == "done"
    agreed = assert_same_greedy(alone, {"generated_tokens": [e["token"] for e in toks]})
    check_rows([decode_attention(e["attention"]) for e in toks], ref, len(ids), agreed, "sse")

    ws = out["ws"]
    assert ws.error is None and ws.done is not None and ws.close_code == 1000
    agreed = assert_same_greedy(alone, {"generated_tokens": ws.tokens})
    check_rows(ws.attention, ref, len(ids), agreed, "ws")


def test_prompt_longer_than_the_context_is_refused_by_every_api(srv: ServerProc) -> None:
    """600 tokens for a 512-token window: each API answers 4xx with ``CONTEXT_OVERFLOW`` and no slot is made."""
    ids = tokenize(srv.url, TEXT * 20)[:600]
    assert len(ids) == 600
    before = {s["id"] for s in httpx.get(srv.url + "/slots").json()}
    posts = [
        ("/completion", {"prompt": ids, "n_predict": 2, "id_slot": 21}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT * 20}], "max_tokens": 2}),
        ("/api/v1/generate", body(ids, "over-g")),
        ("/api/extra/generate/stream", body(ids, "over-s", output_attentions=True)),
    ]
    for path, req in posts:
        r = httpx.post(srv.url + path, json=req, timeout=60)
        assert 400 <= r.status_code < 500 and r.json()["error_code"] == "CONTEXT_OVERFLOW", (path, r.text)
    ws = ws_binary(srv.ws_url, body(ids, "over-w"))
    assert ws.error is not None and ws.error["error_code"] == "CONTEXT_OVERFLOW" and not ws.tokens, ws.error
    assert {s["id"] for s in httpx.get(srv.url + "/slots").json()} == before
    ok = httpx.post(srv.url + "/api/v1/generate", json=body(ids[:20], "after"), timeout=120)
    assert ok.status_code == 200 and len(ok.json()["generated_tokens"]) == N_NEW
