"""Allowed origins on HTTP and WebSockets, no API key in the logs, states too long for the
context (issue 13, found 5, 6 and 10)."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import tokenize

KEY = "k3y-that-must-not-be-logged"
GOOD = "http://good.example:8080"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("guarded")
    args = ["--threads", "2", "--parallel", "1", "--ctx-size", "256", "--api-key", KEY,
            "--allowed-origins", f"{GOOD},http://other.example", "--state-dir", str(work / "state")]  # fmt: skip
    srv = ServerProc(args, work).start()
    yield srv
    srv.stop()


def test_http_cors_follows_the_allow_list(guarded: ServerProc) -> None:
    for origin, allowed in ((GOOD, True), ("http://other.example", True), ("http://evil.example", False)):
        pre = httpx.options(
            guarded.url + "/api/v1/tokenize",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        assert (pre.headers.get("access-control-allow-origin") == origin) is allowed, (origin, pre.headers)
        r = httpx.post(guarded.url + "/api/v1/tokenize", json={"text": "hi"}, headers={"Origin": origin, **AUTH})
        assert (r.headers.get("access-control-allow-origin") == origin) is allowed


def test_a_simple_request_from_another_origin_is_refused_before_it_runs(guarded: ServerProc) -> None:
    """A cross-origin ``text/plain`` POST needs no preflight: CORS would only hide its answer."""
    r = httpx.post(guarded.url + "/api/v1/generate", json={"prompt": "Hi", "max_new_tokens": 1, "id_slot": "o"},
                   headers=AUTH, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain", **AUTH}
    r = httpx.post(guarded.url + "/slots/o", params={"action": "erase"}, content=b"", headers=evil)
    assert r.status_code == 403 and r.json()["error_code"] == "FORBIDDEN", r.text
    assert httpx.post(guarded.url + "/slots/o", params={"action": "tokens"}, headers=AUTH).status_code == 200
    own = {"Origin": guarded.url, **AUTH}  # the admin page's own requests
    assert httpx.post(guarded.url + "/slots/o", params={"action": "tokens"}, headers=own).status_code == 200
    good = {"Origin": GOOD, **AUTH}
    assert httpx.post(guarded.url + "/slots/o", params={"action": "erase"}, headers=good).status_code == 200


def test_websockets_follow_the_allow_list(guarded: ServerProc) -> None:
    url = guarded.ws_url + f"/api/extra/generate/stream/ws?api_key={KEY}"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, origin="http://evil.example")  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    for origin in (GOOD, None):  # an allowed page, and a client that is not a browser
        with connect(url, origin=origin, close_timeout=2) as ws:  # type: ignore[arg-type]
            ws.send(json.dumps({"prompt": "Hi", "max_new_tokens": 1, "output_attentions": False}))
            frames = [json.loads(ws.recv(timeout=60)) for _ in range(2)]
        assert frames[-1]["type"] == "done", frames


def test_api_key_never_reaches_the_log(guarded: ServerProc) -> None:
    r = httpx.get(guarded.url + "/api/v1/model", params={"api_key": KEY})
    assert r.status_code == 200
    assert httpx.get(guarded.url + "/api/v1/model", params={"api_key": "wrong-" + KEY}).status_code == 401
    refused = httpx.post(guarded.url + "/slots/0", params={"api_key": KEY, "action": "nope"})  # logged refusal
    assert refused.status_code == 400 and KEY not in refused.text
    with connect(guarded.ws_url + f"/api/v1/generate/stream?api_key={KEY}", close_timeout=2) as ws:
        ws.send(json.dumps({"prompt": "Hi", "max_new_tokens": 1}))
        assert json.loads(ws.recv(timeout=60))["type"] in ("token", "done")
    log = guarded.log_path.read_text(errors="replace")
    assert "/api/v1/model" in log and "/api/v1/generate/stream" in log  # the requests were logged...
    assert KEY not in log  # ...without their query strings


def test_state_longer_than_the_context_is_refused(server: ServerProc, guarded: ServerProc) -> None:
    """A 295-token state from a 2048-token server does not fit a 256-token context."""
    text = " ".join(f"word{i}" for i in range(150))
    ids = tokenize(server.url, CHAT.format(text))[:295]
    assert len(ids) == 295
    r = httpx.post(
        server.url + "/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 0, "id_slot": "long"}, timeout=120
    )
    assert r.status_code == 200, r.text
    blob = httpx.post(
        server.url + "/slots/long",
        params={"action": "save-state"},
        headers={"Accept": "application/octet-stream"},
        timeout=60,
    ).content
    octet = {"Content-Type": "application/octet-stream", **AUTH}
    r = httpx.post(
        guarded.url + "/slots/fresh", params={"action": "restore-state"}, content=blob, headers=octet, timeout=60
    )
    assert r.status_code == 400 and r.json()["error_code"] == "CONTEXT_OVERFLOW", r.text
    assert httpx.post(guarded.url + "/slots/fresh", params={"action": "tokens"}, headers=AUTH).status_code == 404
    # a slot that exists keeps what it had
    small = [1, 2, 3]
    r = httpx.post(
        guarded.url + "/api/v1/generate",
        json={"input_ids": small, "max_new_tokens": 0, "id_slot": "kept"},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        guarded.url + "/slots/kept", params={"action": "restore-state"}, content=blob, headers=octet, timeout=60
    )
    assert r.status_code == 400 and r.json()["error_code"] == "CONTEXT_OVERFLOW", r.text
    r = httpx.post(guarded.url + "/slots/kept", params={"action": "tokens"}, headers=AUTH)
    assert r.json()["tokens"] == small
