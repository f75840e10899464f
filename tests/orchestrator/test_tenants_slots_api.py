"""Two tenants on a real server with real Redis (docs/operations.md, "Slots by tenant"): everything
one tenant could do to another's conversations, redone as tenant B against tenant A, is now a 404
exactly as for a missing slot, or a cache miss; A's slots are unchanged afterwards.  Also the paired
cache test (vLLM's rule): the same tenant and salt hit; another salt or another tenant gets
``cached_tokens`` 0.

Needs ``--api-keys`` (keys per tenant); skipped on a build without it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest

from orchestrator.config import Settings
from tests.conftest import CHAT, ServerProc
from tests.redis_server import RedisServer

pytestmark = pytest.mark.skipif(
    "api_keys" not in Settings.__struct_fields__, reason="this build has no --api-keys (tenants' keys)"
)

KEYS = "key-a tenant-a\nkey-b tenant-b\nkey-ops ops admin\n"
MEMO = (
    "Private memo for the board: the Lisbon office closes in March, the Porto team moves to remote work, "
    "and the budget for the new data centre is cut by a third. Nobody outside the board may know this yet. "
) * 2


class Reachable(Protocol):
    """A server, or a proxy in front of several (tests/deploy/test_haproxy_tenants.py)."""

    @property
    def url(self) -> str: ...


def h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(srv: Reachable, key: str, text: str, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, headers=h(key), timeout=300)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def action(srv: Reachable, key: str, slot: str, name: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/slots/{slot}", params={"action": name}, headers=h(key), timeout=120, **kw)


def tokens(srv: Reachable, key: str, slot: str) -> list[int]:
    r = action(srv, key, slot, "tokens")
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def same_as_missing(r: httpx.Response, missing: httpx.Response, slot: str, other: str) -> None:
    """``r`` (about another tenant's ``slot``) answers as ``missing`` (about the unknown ``other``)."""
    assert r.status_code == missing.status_code == 404, (r.text, missing.text)
    assert r.text.replace(slot, "ID") == missing.text.replace(other, "ID")


@pytest.fixture
def srv(start_server: Callable[..., ServerProc], redis_server: RedisServer, tmp_path: Path) -> ServerProc:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    (tmp_path / "files").mkdir()
    return start_server(
        *("--parallel", "3", "--ctx-size", "2048", "--api-keys", str(keys)),
        *("--redis-url", redis_server.url, "--key-prefix", "tenants32:", "--slot-save-path", str(tmp_path / "files")),
    )


def test_tenant_b_cannot_reach_tenant_a_and_caches_stay_apart(srv: ServerProc) -> None:
    b_against_a(srv)


def b_against_a(srv: Reachable) -> list[int]:
    """Everything B could do to A's conversations, as B: 404 or a miss; A's slots unchanged; the paired
    cache test.  Returns A's slot ``chat1``'s tokens (it is left as A made it)."""
    native = {"input_ids": None, "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "id_slot": "chat1"}
    tok = httpx.post(srv.url + "/api/v1/tokenize", json={"text": CHAT.format(MEMO)}, headers=h("key-a"), timeout=60)
    ids = tok.json()["token_ids"]
    r = httpx.post(srv.url + "/api/v1/generate", json={**native, "input_ids": ids}, headers=h("key-a"), timeout=300)
    assert r.status_code == 200, r.text
    a_anon = chat(srv, "key-a", MEMO)  # A's anonymous conversation
    assert a_anon.status_code == 200, a_anon.text
    anon_id = a_anon.headers["x-slot-id"]
    a_chat1, a_anon_tokens = tokens(srv, "key-a", "chat1"), tokens(srv, "key-a", anon_id)

    # B lists, reads, copies, overwrites and erases: every call about A's slots is a 404 as for a missing one
    listed = {str(s["id"]) for s in httpx.get(srv.url + "/slots", headers=h("key-b")).json()}
    assert "chat1" not in listed and anon_id not in listed
    admin = {(s.get("tenant"), str(s["id"])) for s in httpx.get(srv.url + "/slots", headers=h("key-ops")).json()}
    assert ("tenant-a", "chat1") in admin and ("tenant-a", anon_id) in admin, "an admin sees every tenant's"
    for slot in ("chat1", anon_id):
        for name in ("tokens", "save-state"):
            same_as_missing(action(srv, "key-b", slot, name), action(srv, "key-b", "nope-1", name), slot, "nope-1")
        info = httpx.get(f"{srv.url}/v1/slots/{slot}/info", headers=h("key-b"))
        same_as_missing(info, httpx.get(f"{srv.url}/v1/slots/nope-2/info", headers=h("key-b")), slot, "nope-2")
        for name, body in (("fork", {"target": "mine"}), ("save", {"filename": "x.bin"})):
            r = action(srv, "key-b", slot, name, json=body)
            assert r.status_code in (401, 403, 404), r.text  # refused before or as a missing slot
        r = action(srv, "key-b", slot, "erase")
        assert r.status_code in (401, 403, 404), r.text
    # B names A's slot in a generation: B's own chat1, empty
    r = httpx.post(srv.url + "/api/v1/generate", json={**native, "input_ids": ids}, headers=h("key-b"), timeout=300)
    assert r.status_code == 200 and r.json()["cached_tokens"] == 0, r.text
    # B sends A's memo plus a question with no slot: a miss, never A's anonymous slot
    b_guess = chat(srv, "key-b", MEMO + " Is the Lisbon office closing?")
    assert cached(b_guess) == 0 and b_guess.headers["x-slot-id"] != anon_id
    # A's slots are unchanged
    assert tokens(srv, "key-a", "chat1") == a_chat1 and tokens(srv, "key-a", anon_id) == a_anon_tokens

    # the paired cache test: same tenant and salt hit; another salt or tenant miss
    assert cached(chat(srv, "key-a", MEMO + " Is the Lisbon office closing?")) > 0
    assert cached(chat(srv, "key-a", MEMO + " What about Porto?", cache_salt="s2")) == 0
    return a_chat1
