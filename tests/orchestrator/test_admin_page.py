"""The admin page in a real browser: Debian's headless Chromium driven by Playwright.

Skipped when ``/usr/bin/chromium`` or the ``playwright`` package is missing
(``scripts/setup test`` installs both; Playwright never downloads a browser here).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import sse_events

CHROMIUM = Path("/usr/bin/chromium")
API_KEY, ADMIN_KEY = "api-secret", "admin-secret"
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's /usr/bin/chromium")


def api(srv: ServerProc, key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def converse(srv: ServerProc, slot: str, text: str, n: int, attention: bool = False) -> list[dict[str, Any]]:
    body = {"prompt": CHAT.format(text), "max_new_tokens": n, "temperature": 0, "conversation_id": slot}
    if attention:
        return sse_events(srv.url, body | {"output_attentions": True, "ignore_eos": True}, headers=api(srv))
    r = httpx.post(srv.url + "/api/v1/generate", json=body, headers=api(srv), timeout=120)
    assert r.status_code == 200, r.text
    return [r.json()]


@pytest.fixture
def admin_server(start_server: Callable[..., ServerProc], tmp_path: Path) -> ServerProc:
    return start_server(
        *("--parallel", "2", "--ctx-size", "1024", "--api-key", API_KEY, "--admin-key", ADMIN_KEY),
        *("--state-dir", str(tmp_path / "state"), "--slot-save-path", str(tmp_path / "files")),
    )


def test_refused_without_the_admin_key(admin_server: ServerProc) -> None:
    srv = admin_server
    for headers, query in [({}, ""), (api(srv), ""), (api(srv), "?admin_key=wrong"), (api(srv, "wrong"), "")]:
        for path in ("/admin", "/admin/api/slots", "/admin/events"):
            r = httpx.get(srv.url + path + query, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED", (path, headers, r.text)
    converse(srv, "kept", "hi", 2)
    for action, body in [("erase", {}), ("context-shift", {"n_keep": 0, "n_discard": 1}), ("fork", {"target": "x"})]:
        r = httpx.post(f"{srv.url}/slots/kept?action={action}", json=body, headers=api(srv), timeout=10)
        assert r.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED", r.text
    # read-only listing follows --api-key; nothing was changed by the refused actions
    listing = httpx.get(srv.url + "/slots", headers=api(srv), timeout=10).json()
    # llama-server's numbered slots 0..n_parallel-1 first (unused: "empty"), then the named conversations
    assert [s["id"] for s in listing] == [0, 1, "kept"] and [s["place"] for s in listing[:2]] == ["empty", "empty"]
    assert listing[2]["named"] is True and listing[2]["n_tokens"] > 0
    r = httpx.post(f"{srv.url}/slots/kept?action=tokens", headers=api(srv), timeout=10)
    assert r.status_code == 200
    # the admin key passes both checks
    admin = {"X-Admin-Key": ADMIN_KEY}
    r = httpx.get(srv.url + "/admin", headers=admin, timeout=10)
    assert r.status_code == 200 and "slotserve admin" in r.text


def test_admin_api_with_the_key(admin_server: ServerProc) -> None:
    srv = admin_server
    admin = {"X-Admin-Key": ADMIN_KEY}
    converse(srv, "kept", "hi", 4)
    msgs = httpx.get(srv.url + "/admin/api/slots/kept/messages", headers=admin, timeout=10).json()
    assert [m["index"] for m in msgs["messages"]] == list(range(len(msgs["messages"])))
    assert "hi" in msgs["messages"][0]["text"] and msgs["messages"][0]["start"] == 0
    assert msgs["messages"][-1]["end"] == msgs["n_tokens"] - 1
    r = httpx.post(f"{srv.url}/slots/kept?action=fork", json={"target": "copy"}, headers=admin, timeout=30)
    assert r.status_code == 200 and r.json()["n_tokens"] == msgs["n_tokens"], r.text
    first = msgs["messages"][0]
    r = httpx.post(
        f"{srv.url}/slots/copy?action=context-shift",
        json={"n_keep": 0, "n_discard": first["end"] + 1},
        headers=admin,
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["new_n_tokens"] == msgs["n_tokens"] - first["end"] - 1, r.text
    r = httpx.post(f"{srv.url}/slots/kept?action=save", json={"filename": "kept.bin"}, headers=admin, timeout=30)
    assert r.status_code == 200 and r.json()["n_saved"] == msgs["n_tokens"], r.text
    listing = {s["id"]: s for s in httpx.get(srv.url + "/admin/api/slots", headers=admin, timeout=10).json()}
    assert set(listing) == {"kept", "copy"}
    assert listing["copy"]["n_tokens"] == msgs["n_tokens"] - first["end"] - 1
    assert listing["kept"]["n_messages"] == len(msgs["messages"])
    assert all(s["place"] in ("kv_cache", "host") and s["owner"] for s in listing.values())
    assert httpx.get(srv.url + "/admin/api/slots/nope/messages", headers=admin, timeout=10).status_code == 404
    r = httpx.get(srv.url + "/admin/events?layer=99", headers=admin, timeout=10)
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"


def test_no_slots_turns_the_listing_off(start_server: Callable[..., ServerProc]) -> None:
    srv = start_server("--parallel", "1", "--ctx-size", "512", "--no-slots", "--no-persist")
    r = httpx.get(srv.url + "/slots", timeout=10)
    assert r.status_code == 501 and r.json()["error_code"] == "NOT_SUPPORTED"


def test_admin_page_live(admin_server: ServerProc, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    srv = admin_server
    shot = tmp_path / "admin.png"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{srv.url}/admin?admin_key={ADMIN_KEY}")
        page.wait_for_selector("#conn.live", timeout=20_000)
        assert "admin_key" not in page.url  # the key is taken out of the address bar

        converse(srv, "alpha", "Name three colours.", 8)
        page.wait_for_selector('tr[data-slot="alpha"]', timeout=20_000)

        beta: list[list[dict[str, Any]]] = []
        runner = threading.Thread(target=lambda: beta.append(converse(srv, "beta", "Tell me a story.", 120, True)))
        runner.start()
        try:
            page.wait_for_selector('tr[data-slot="beta"] td.gen', timeout=30_000)
            page.wait_for_function("Number(document.getElementById('heatmap').dataset.rows) >= 5", timeout=30_000)
            n1 = int(page.get_attribute("#heatmap", "data-rows") or 0)
            page.wait_for_function(f"Number(document.getElementById('heatmap').dataset.rows) > {n1}", timeout=30_000)
            assert "beta" in page.inner_text("#hm-slot")
            page.select_option("#layer", "3")
            page.wait_for_function(
                "document.getElementById('hm-info').textContent.includes('(layer 3')", timeout=30_000
            )
            page.wait_for_function("Number(document.getElementById('heatmap').dataset.rows) >= 8", timeout=60_000)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            runner.join(600)
        assert beta and beta[0][-1]["type"] == "done"

        # alpha's messages, then erase it from the page
        page.click('tr[data-slot="alpha"]')
        page.wait_for_selector("#messages .msg", timeout=20_000)
        assert "Name three colours." in page.inner_text("#messages")
        page.on("dialog", lambda d: d.accept())
        page.click("#erase")
        page.wait_for_selector('tr[data-slot="alpha"]', state="detached", timeout=20_000)
        page.screenshot(path=str(tmp_path / "admin-after-erase.png"), full_page=True)
        assert not errors, errors
        browser.close()
    ids = [s["id"] for s in httpx.get(srv.url + "/slots", headers=api(srv), timeout=10).json()]
    assert "alpha" not in ids and "beta" in ids
    assert shot.stat().st_size > 10_000
    print(f"screenshots: {shot} and {tmp_path / 'admin-after-erase.png'}")
