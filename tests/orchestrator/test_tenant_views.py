"""What one tenant sees of the others on a real server (docs/operations.md, "Tenants"): ``/health``
counts the caller's tenant's slots only, KoboldCpp's ``perf``, ``generate/check`` and ``abort`` see
and stop only the caller's generations, the admin page's slot actions reach the tenant of the slot
they name (an admin's ``?tenant=``; a user naming another tenant is refused before any slot is
looked at), and a preview naming no slot forks the conversation its session header keeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.test_tenants_server import StalledReader

KEYS = "key-a tenant-a\nkey-b tenant-b\nkey-c tenant-c\nkey-d tenant-d\nkey-ops ops admin\n"


def h(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work: Path = tmp_path_factory.mktemp("views")
    (work / "keys.txt").write_text(KEYS)
    (work / "files").mkdir()
    args = ["--threads", "2", "--parallel", "2", "--ctx-size", "2048", "--api-keys", str(work / "keys.txt")]
    args += ["--stall-timeout", "0"]  # the Kobold test holds a generation with a stalled reader
    s = ServerProc([*args, "--slot-save-path", str(work / "files")], work).start()
    yield s
    s.stop()


def generate(srv: ServerProc, key: str, slot: str | None, text: str, **headers: str) -> httpx.Response:
    body: dict[str, Any] = {"prompt": CHAT.format(text), "max_new_tokens": 2, "temperature": 0}
    if slot is not None:
        body["conversation_id"] = slot
    r = httpx.post(srv.url + "/api/v1/generate", json=body, headers=h(key, **headers), timeout=300)
    assert r.status_code == 200, r.text
    return r


def health(srv: ServerProc, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = httpx.get(srv.url + "/health", headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def slot_tokens(srv: ServerProc, key: str, slot: str, tenant: str | None = None) -> httpx.Response:
    params = {"action": "tokens", **({"tenant": tenant} if tenant else {})}
    return httpx.post(f"{srv.url}/slots/{slot}", params=params, headers=h(key), timeout=60)


def test_health_counts_only_the_callers_slots(srv: ServerProc) -> None:
    for slot in ("h1", "h2"):  # tenants c and d are this test's alone
        generate(srv, "key-c", slot, "Name a colour.")
    generate(srv, "key-d", "h1", "Name a fruit.")
    c, d, ops, nobody = health(srv, h("key-c")), health(srv, h("key-d")), health(srv, h("key-ops")), health(srv)
    assert c["status"] == d["status"] == nobody["status"] == "ok", "llama-server's body shape, status as before"
    assert (c["slots_idle"], c["slots_processing"], d["slots_idle"], d["slots_processing"]) == (2, 0, 1, 0)
    assert ops["slots_idle"] + ops["slots_processing"] >= 3, "an admin counts every tenant's"
    assert nobody["slots_idle"] == nobody["slots_processing"] == 0, "no key shown: nothing of anyone's"
    bad = health(srv, h("not-a-key"))
    assert bad["slots_idle"] == bad["slots_processing"] == 0, "a wrong key is not refused, and sees nothing"


def test_kobold_jobs_are_the_callers_own(srv: ServerProc) -> None:
    ids = httpx.post(
        srv.url + "/api/v1/tokenize", json={"text": "The river valley, year by year. " * 20}, headers=h("key-a")
    ).json()["token_ids"]
    body = {
        "input_ids": ids, "max_new_tokens": 1500, "ignore_eos": True, "output_attentions": True,
        "attention_format": "per_layer", "conversation_id": "held", "genkey": "KCPP4242",
    }  # fmt: skip
    reader = StalledReader(srv, "key-a", body)  # A's generation, held by its stalled reader
    try:
        check = {"genkey": "KCPP4242"}
        mine = httpx.post(srv.url + "/api/extra/generate/check", json=check, headers=h("key-a"), timeout=30).json()
        theirs = httpx.post(srv.url + "/api/extra/generate/check", json=check, headers=h("key-b"), timeout=30).json()
        assert mine["results"][0]["text"] != "" and theirs["results"][0]["text"] == "", (mine, theirs)
        perf_a = httpx.get(srv.url + "/api/extra/perf", headers=h("key-a"), timeout=30).json()
        perf_b = httpx.get(srv.url + "/api/extra/perf", headers=h("key-b"), timeout=30).json()
        assert perf_a["idle"] == 0 and perf_b["idle"] == 1 and perf_b["queue"] == 0, (perf_a, perf_b)
        for genkey in ("KCPP4242", ""):  # B's abort, by A's genkey or of every generation without one
            r = httpx.post(srv.url + "/api/extra/abort", json={"genkey": genkey}, headers=h("key-b"), timeout=60)
            assert r.json()["success"] == "false", r.text
        mine = httpx.post(srv.url + "/api/extra/generate/check", json=check, headers=h("key-a"), timeout=30).json()
        assert mine["results"][0]["text"] != "", "A's generation still runs"
        r = httpx.post(srv.url + "/api/extra/abort", json=check, headers=h("key-a"), timeout=60)
        assert r.json()["success"] == "true", r.text
    finally:
        reader.close()


def test_admin_acts_on_the_tenant_its_page_names(srv: ServerProc) -> None:
    generate(srv, "key-a", "page1", "Name a planet.")
    before = slot_tokens(srv, "key-a", "page1").json()["tokens"]
    missing = slot_tokens(srv, "key-b", "page1", "ops")
    for key, tenant in (("key-b", "tenant-a"), ("key-b", "nobody")):  # a user naming a tenant: refused alike
        r = slot_tokens(srv, key, "page1", tenant)
        assert r.status_code == missing.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED", r.text
    assert slot_tokens(srv, "key-a", "page1", "tenant-a").json()["tokens"] == before, "its own tenant named"
    assert slot_tokens(srv, "key-ops", "page1", "tenant-a").json()["tokens"] == before
    for bad in ("tenant-a/..", "", "x" * 65):  # not a tenant name: 400, nothing erased
        r = httpx.post(f"{srv.url}/slots/page1", params={"tenant": bad, "action": "erase"}, headers=h("key-ops"))
        assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST", r.text
    assert slot_tokens(srv, "key-a", "page1").json()["tokens"] == before
    act = f"{srv.url}/slots/page1"
    q = {"tenant": "tenant-a"}
    r = httpx.post(act, params={**q, "action": "save"}, json={"filename": "page1.bin"}, headers=h("key-ops"))
    assert r.status_code == 200 and r.json()["n_saved"] == len(before), r.text
    r = httpx.post(act, params={**q, "action": "fork"}, json={"target": "page1-copy"}, headers=h("key-ops"))
    assert r.status_code == 200, r.text
    assert slot_tokens(srv, "key-a", "page1-copy").json()["tokens"] == before, "the fork is tenant-a's"
    r = httpx.post(act, params={**q, "action": "restore"}, json={"filename": "page1.bin"}, headers=h("key-ops"))
    assert r.status_code == 200 and r.json()["n_restored"] == len(before), r.text
    r = httpx.post(act, params={**q, "action": "erase"}, headers=h("key-ops"), timeout=60)
    assert r.status_code == 200, r.text
    assert slot_tokens(srv, "key-a", "page1").status_code == 404, "erased in tenant-a"
    assert slot_tokens(srv, "key-ops", "page1").status_code == 404, "the admin's own tenant untouched"


def test_preview_forks_the_session_headers_conversation(srv: ServerProc) -> None:
    session = {"X-Session-Id": "preview-session-1"}
    keyed = generate(srv, "key-a", None, "Tell me about owls.", **session)
    other = generate(srv, "key-a", None, "Explain the tides, briefly.")  # the tenant's latest request
    assert keyed.headers["x-slot-id"] != other.headers["x-slot-id"]
    body = {"max_tokens": 2, "temperature": 0}
    r = httpx.post(srv.url + "/api/v1/generate/preview", json=body, headers=h("key-a", **session), timeout=120)
    assert r.status_code == 200 and r.json()["cache_hit"], r.text
    assert r.json()["slot_id"] == keyed.headers["x-slot-id"], r.text
    r = httpx.post(srv.url + "/api/v1/generate/preview", json=body, headers=h("key-b", **session), timeout=120)
    assert r.status_code == 400 and r.json()["error_code"] == "NO_CACHED_CONTEXT", "another tenant's: no cache"
