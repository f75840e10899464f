"""Two tenants through deploy/haproxy.cfg in front of two slotserve nodes on one redis-server started
by the test: tests/orchestrator/test_tenants_slots_api.py's B-against-A sequence, redone through the
proxy (B's requests naming A's slot ids hash to a node by B's key, so they may reach the node that
holds A's slot or the other one, which only finds A's slot in the shared store): every call of B
that reached A's data is a 404 or a miss, A's slots are unchanged, and A's conversation then
continues, with its cache, on whichever node the proxy sends it to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.conftest import ServerProc
from tests.deploy.haproxy_proc import HAProxy
from tests.orchestrator.test_tenants_slots_api import KEYS, b_against_a, h, tokens
from tests.redis_server import RedisServer


def test_tenant_b_cannot_reach_tenant_a_through_the_proxy(
    start_server: Callable[..., ServerProc], own_redis: RedisServer, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    (tmp_path / "files").mkdir()
    common = ("--parallel", "3", "--ctx-size", "2048", "--api-keys", str(keys), "--redis-url", own_redis.url,
              "--key-prefix", "px32:", "--slot-save-path", str(tmp_path / "files"))  # fmt: skip
    nodes = [start_server(*common, "--node-id", name) for name in ("node-1", "node-2")]
    with HAProxy([f"127.0.0.1:{n.port}" for n in nodes], tmp_path / "haproxy.log") as proxy:
        while httpx.get(proxy.url + "/health", timeout=30).status_code != 200:  # first health checks
            time.sleep(0.1)
        chat1 = b_against_a(proxy)
        # A's conversation goes on through the proxy: its whole slot is the cache of its next turn
        body = {"input_ids": [*chat1, *chat1[:3]], "max_new_tokens": 2, "temperature": 0, "id_slot": "chat1"}
        r = httpx.post(proxy.url + "/api/v1/generate", json=body, headers=h("key-a"), timeout=300)
        assert r.status_code == 200 and r.json()["cached_tokens"] == len(chat1), r.text
        assert tokens(proxy, "key-a", "chat1")[: len(chat1) + 3] == [*chat1, *chat1[:3]]
