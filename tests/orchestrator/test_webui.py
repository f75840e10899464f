"""The chat page at ``/`` in a real browser: Debian's headless Chromium driven by Playwright.

The page talks to the server only through the public API with the key typed into it, so the test
checks what a user sees against what the server sent: the heat map's values (each context token's
``data-w``) equal the attention rows of the binary WebSocket frames the browser received (read from
the network, beside the page's own code) and an independent SSE request's rows for the same
``input_ids``; the conversation's slot saved, erased and restored from the page continues from its
KV cache.  ``--no-webui`` makes ``/`` a 404 as llama-server's ``--no-ui`` does (its ``test_no_ui``).
Skipped when ``/usr/bin/chromium`` or ``playwright`` is missing (Playwright never downloads a browser).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import decode_attention, sse_events

CHROMIUM = Path("/usr/bin/chromium")
API_KEY = "webui-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's /usr/bin/chromium")


@pytest.fixture
def webui_server(start_server: Callable[..., ServerProc], tmp_path: Path) -> ServerProc:
    # a batch of 32 tokens: every turn's prompt is prefilled in several batches
    return start_server(
        *("--parallel", "2", "--ctx-size", "1024", "--batch-size", "32", "--ubatch-size", "32"),
        *("--api-key", API_KEY, "--state-dir", str(tmp_path / "state")),
    )


class Frames:
    """What the browser's WebSockets carried, read from the network (Playwright's frame events)."""

    def __init__(self) -> None:
        self.streams: list[dict[str, Any]] = []

    def attach(self, ws: Any) -> None:
        stream: dict[str, Any] = {"url": ws.url, "config": None, "tokens": [], "rows": [], "done": None}
        self.streams.append(stream)

        def sent(payload: str | bytes) -> None:
            stream["config"] = json.loads(payload)

        def received(payload: str | bytes) -> None:
            if isinstance(payload, bytes):
                tok = stream["tokens"][-1]
                stream["rows"].append(np.frombuffer(payload, dtype="<f4").reshape(tok["shape"]))
                return
            ev = json.loads(payload)
            if ev["type"] == "token":
                stream["tokens"].append(ev)
            elif ev["type"] in ("done", "error"):
                stream["done"] = ev

        ws.on("framesent", sent)
        ws.on("framereceived", received)


def heat_map(page: Any) -> tuple[int, dict[int, float]]:
    """The generated token the page shows and each context position's weight (``data-w``) it holds."""
    k = int(page.get_attribute("#context", "data-token"))
    pairs = page.eval_on_selector_all(
        "#context .tok[data-w]", "els => els.map(e => [Number(e.dataset.i), e.dataset.w])"
    )
    return k, {int(i): float(w) for i, w in pairs}


def send(page: Any, frames: Frames, text: str) -> dict[str, Any]:
    """Type ``text``, send it, wait for the reply's end; the stream's frames."""
    n = len(frames.streams)
    page.fill("#message", text)
    page.click("#send")
    page.wait_for_function(
        "document.querySelectorAll('#transcript .msg').length >= 2 && !document.getElementById('send').disabled",
        timeout=600_000,
    )
    assert len(frames.streams) == n + 1, "one WebSocket per turn"
    stream = frames.streams[-1]
    page.wait_for_function("!document.getElementById('status').textContent.startsWith('prefill')", timeout=60_000)
    assert stream["done"] is not None and stream["done"]["type"] == "done", stream["done"]
    return stream


def pick_token(page: Any, k: int) -> None:
    page.click(f'#context .tok.gen[data-k="{k}"]')
    page.wait_for_selector(f'#context[data-token="{k}"]', timeout=60_000)


def test_chat_heat_map_and_slot_actions(webui_server: ServerProc, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    srv = webui_server
    frames = Frames()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 900}, accept_downloads=True)
        page.set_default_timeout(120_000)  # a 2-core machine shared by many test runs answers slowly
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: d.accept())
        page.on("websocket", frames.attach)
        page.goto(srv.url + "/")

        # the page loads without a key; the API refuses it until the right key is typed in
        page.wait_for_function("document.getElementById('status').textContent.includes('API key')", timeout=60_000)
        page.fill("#api-key", "wrong")
        page.click("#key-form button")
        page.wait_for_function("document.getElementById('status').className === 'err'", timeout=60_000)
        page.fill("#api-key", API_KEY)
        page.click("#key-form button")
        page.wait_for_selector("#model:has-text('30 layers')", timeout=60_000)
        assert page.evaluate("sessionStorage.getItem('slotserve.webui.apiKey')") == API_KEY
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "6")

        # turn 1, while another client generates on another conversation
        other: list[list[dict[str, Any]]] = []
        body = {"prompt": CHAT.format("Tell me a story."), "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        runner = threading.Thread(
            target=lambda: other.append(sse_events(srv.url, body | {"conversation_id": "other"}, AUTH))
        )
        runner.start()
        try:
            first = send(page, frames, "Name three colours.")
        finally:
            runner.join(300)
        assert other and other[0][-1]["finish_reason"] == "length"
        slot = page.inner_text("#chat-slot")
        config = first["config"]
        assert config["conversation_id"] == slot and config["attention_format"] == "aggregated"
        n_prompt, n_gen = len(config["input_ids"]), len(first["tokens"])
        assert n_prompt > 32 and n_gen >= 4, (n_prompt, n_gen)

        # the heat map of a chosen token holds exactly the row the stream carried for it
        pick_token(page, 3)
        k, weights = heat_map(page)
        row = first["rows"][3]
        assert k == 3 and row.shape == (n_prompt + 3,) and sorted(weights) == list(range(n_prompt + 3))
        assert all(weights[i] == float(row[i]) for i in weights)
        assert page.get_attribute(f'#context .tok[data-i="{n_prompt + 3}"]', "class").split().count("selected") == 1
        assert abs(float(row.sum()) - 1) < 1e-3

        # an independent request with the same ids: the same tokens and rows
        ref = sse_events(
            srv.url,
            {
                "input_ids": config["input_ids"],
                "max_new_tokens": 4,
                "temperature": 0,
                "conversation_id": "ref",
                "output_attentions": True,
                "attention_format": "aggregated",
            },
            AUTH,
        )
        ref_tokens = [e for e in ref if e["type"] == "token"]
        assert [e["token"]["token_id"] for e in ref_tokens] == [t["token_id"] for t in first["tokens"][:4]]
        ref_row = decode_attention(ref_tokens[3]["attention"])
        diff = float(np.abs(ref_row - np.array([weights[i] for i in range(n_prompt + 3)])).max())
        print(f"turn 1: {n_prompt} prompt tokens; page vs independent request, token 3: max abs diff {diff:.3g}")
        assert diff < 1e-4

        # turn 2 reuses the slot's KV cache; the page follows the newest token
        second = send(page, frames, "And three animals?")
        assert second["config"]["conversation_id"] == slot
        assert second["done"]["cached_tokens"] >= n_prompt, second["done"]
        k, weights = heat_map(page)
        assert k == len(second["tokens"]) - 1
        assert (
            all(weights[i] == float(second["rows"][k][i]) for i in weights) and len(weights) == second["rows"][k].size
        )
        assert page.locator("#transcript .msg").count() == 4
        mid = len(second["tokens"]) - 3  # a token in the middle of the reply: later ones are faded
        pick_token(page, mid)
        assert page.locator("#context .tok.future").count() == 2
        page.screenshot(path=str(tmp_path / "webui.png"))  # docs/webui.png

        # a layer and a head: the next reply streams that layer per head
        page.select_option("#layer", "3")
        page.select_option("#head", "2")
        third = send(page, frames, "Which one is your favourite?")
        assert third["config"]["attention_format"] == "per_layer" and third["config"]["attention_layers"] == [3]
        pick_token(page, 1)
        _, weights = heat_map(page)
        per_head = third["rows"][1]
        assert per_head.shape[:2] == (1, 9)
        assert page.get_attribute("#context", "data-head") == "2"
        assert all(weights[i] == float(per_head[0, 2, i]) for i in weights) and len(weights) == per_head.shape[2]
        page.select_option("#head", "")  # the mean over the layer's heads, from the same frames
        page.wait_for_selector('#context[data-head=""]', timeout=60_000)
        _, weights = heat_map(page)
        mean = per_head[0].mean(axis=0)
        assert max(abs(weights[i] - float(mean[i])) for i in weights) < 1e-6

        # save (a download), erase, restore the file: the same KV state comes back and the chat goes on
        n_tokens = len(third["config"]["input_ids"]) + len(third["tokens"])
        with page.expect_download() as dl:
            page.click("#save")
        saved = tmp_path / "saved.slot.json"
        dl.value.save_as(saved)
        file = json.loads(saved.read_text())
        assert file["slot_id"] == slot and len(file["messages"]) == 6 and file["n_tokens"] == n_tokens
        state = base64.b64decode(file["state"])
        assert state[:4] == b"SES1" and int.from_bytes(state[4:8], "little") == n_tokens
        page.click("#erase")
        page.wait_for_selector(f'#slots li[data-slot="{slot}"]', state="detached", timeout=60_000)
        listed = [str(s["id"]) for s in httpx.get(srv.url + "/slots", headers=AUTH, timeout=60).json()]
        assert slot not in listed and "other" in listed

        # a file that is no state: refused, nothing created
        junk = tmp_path / "junk.ses1"
        junk.write_bytes(b"SES1" + b"\xff" * 64)
        page.set_input_files("#restore-file", str(junk))
        page.fill("#restore-target", "junk")
        page.click("#restore")
        page.wait_for_function("document.getElementById('status').textContent.includes('BAD_STATE')", timeout=60_000)
        r = httpx.post(srv.url + "/slots/junk?action=tokens", headers=AUTH, timeout=60)
        assert r.status_code == 404, r.text

        page.set_input_files("#restore-file", str(saved))
        assert page.input_value("#restore-target") == "junk"  # a name typed before is kept
        page.fill("#restore-target", slot)
        page.click("#restore")
        page.wait_for_selector(f'#slots li[data-slot="{slot}"].current', timeout=60_000)
        page.wait_for_function("document.querySelectorAll('#transcript .msg').length === 6", timeout=60_000)
        tokens = httpx.post(f"{srv.url}/slots/{slot}?action=tokens", headers=AUTH, timeout=60).json()
        assert tokens["n_tokens"] == n_tokens
        assert tokens["tokens"] == third["config"]["input_ids"] + [t["token_id"] for t in third["tokens"]]
        fourth = send(page, frames, "Thanks!")
        assert fourth["done"]["cached_tokens"] >= len(third["config"]["input_ids"]), fourth["done"]

        # fork: a copy-on-write copy under a new id, opened with the same messages
        page.fill("#fork-target", "branch")
        page.click("#fork")
        page.wait_for_selector('#slots li[data-slot="branch"].current', timeout=60_000)
        assert page.locator("#transcript .msg").count() == 8
        a = httpx.post(f"{srv.url}/slots/{slot}?action=tokens", headers=AUTH, timeout=60).json()["tokens"]
        b = httpx.post(srv.url + "/slots/branch?action=tokens", headers=AUTH, timeout=60).json()["tokens"]
        assert a == b and len(a) > n_tokens
        assert not errors, errors
        browser.close()
    print(f"screenshot: {tmp_path / 'webui.png'}")


def test_page_and_assets_are_public_and_bad_paths_refused(webui_server: ServerProc) -> None:
    srv = webui_server
    r = httpx.get(srv.url + "/", timeout=60)  # no key: the page holds no data
    assert (
        r.status_code == 200
        and r.text.startswith("<!doctype html>")
        and r.headers["content-type"].startswith("text/html")
    )
    for name, kind in [("chat.js", "javascript"), ("api.js", "javascript"), ("webui.css", "text/css")]:
        r = httpx.get(f"{srv.url}/webui/{name}", timeout=60)
        assert r.status_code == 200 and kind in r.headers["content-type"], (name, r.headers)
    assert httpx.get(srv.url + "/slots", timeout=60).status_code == 401  # the API still needs the key
    for path in ("/webui/nope.js", "/webui/../pyproject.toml", "/webui/%2e%2e/routes.py", "/index.html"):
        r = httpx.get(srv.url + path, timeout=60)
        assert r.status_code in (401, 404) and r.json()["error_code"] in ("NOT_FOUND", "UNAUTHORIZED"), (path, r.text)
    r = httpx.post(srv.url + "/", json={}, headers=AUTH, timeout=60)
    assert r.status_code == 405 and r.json()["error_code"] == "METHOD_NOT_ALLOWED", r.text


def test_no_webui(start_server: Callable[..., ServerProc]) -> None:
    srv = start_server("--parallel", "1", "--ctx-size", "512", "--no-persist", "--no-webui")
    for path in ("/", "/webui/chat.js"):
        r = httpx.get(srv.url + path, timeout=60)
        assert r.status_code == 404 and r.json()["error_code"] == "NOT_FOUND", (path, r.text)
    assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
