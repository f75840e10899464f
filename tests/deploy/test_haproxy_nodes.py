"""deploy/haproxy.cfg in front of real slotserve nodes on one redis-server started by the test.

Two nodes (the configuration's third node points at a port where nothing listens: its health
checks fail from the start, so its share of the ring goes to the live nodes).  Through the proxy
no conversation ever meets 409 ``SLOT_BUSY`` while the nodes live; after kill -9 of a node, its
conversations answer again, with their state, once the proxy's health checks took the node off
the ring and its leases lapsed (that time is printed, ``pytest -s``, not asserted).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from storage.redis_store import RedisStore
from tests.conftest import CHAT, ServerProc
from tests.deploy.haproxy_proc import HAProxy
from tests.orchestrator.client import assert_same_greedy, tokenize
from tests.orchestrator.test_persistence import toks
from tests.redis_server import RedisServer

LEASE_MS = 2000
QUESTIONS = ["Name a planet.", "What is 3+4?", "Name a red fruit.", "Say hello in French."]


def generate(url: str, slot: str, ids: list[int]) -> httpx.Response:
    body = {"input_ids": ids, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "id_slot": slot, "n_probs": 5}
    return httpx.post(url + "/api/v1/generate", json=body, timeout=180)


def owner(redis: RedisServer, slot: str) -> str | None:
    async def ask() -> str | None:
        store = RedisStore.from_url(redis.url, prefix="px:")
        try:
            return await store.lease_owner(slot)
        finally:
            await store.close()

    return asyncio.run(ask())


def test_through_the_proxy_no_conversation_meets_slot_busy_and_a_dead_nodes_move(
    start_server: Callable[..., ServerProc], own_redis: RedisServer, tmp_path: Path
) -> None:
    common = ("--parallel", "4", "--ctx-size", "1024", "--redis-url", own_redis.url, "--key-prefix", "px:",
              "--lease-ms", str(LEASE_MS))  # fmt: skip
    nodes = {name: start_server(*common, "--node-id", name) for name in ("node-1", "node-2")}
    with HAProxy([f"127.0.0.1:{n.port}" for n in nodes.values()], tmp_path / "haproxy.log") as proxy:
        while httpx.get(proxy.url + "/health", timeout=30).status_code != 200:  # first health checks
            time.sleep(0.1)
        convs = {f"conv-{i}": tokenize(proxy.url, CHAT.format(q)) for i, q in enumerate(QUESTIONS)}
        for _turn in range(2):
            for slot, ids in convs.items():
                r = generate(proxy.url, slot, ids)
                assert r.status_code == 200, f"{slot}: {r.status_code} {r.text}"
                convs[slot] = ids + toks(r.json()) + tokenize(proxy.url, "\nMore?")
        owners = {slot: owner(own_redis, slot) for slot in convs}
        assert set(owners.values()) <= set(nodes) and None not in owners.values()
        victim = next(iter(owners.values()))
        moving = [s for s, o in owners.items() if o == victim]
        staying = [s for s, o in owners.items() if o != victim]
        survivor = nodes[next(n for n in nodes if n != victim)]
        nodes[victim].stop(signal.SIGKILL)
        t0 = time.monotonic()
        for slot in moving:
            ids = convs[slot]
            while True:  # a client retrying as told (Retry-After) until the conversation's new node takes it
                sent = time.monotonic()
                r = generate(proxy.url, slot, ids)
                if r.status_code == 200:
                    break
                assert r.status_code in (409, 502, 503), r.text
                time.sleep(0.2)
            print(f"\n{slot}: answered again through the proxy {sent - t0:.2f} s after kill -9 of its node"
                  f" (lease {LEASE_MS} ms, health checks every 1 s, down after 2)")  # fmt: skip
            out = r.json()
            prefix = len(ids) - len(tokenize(proxy.url, "\nMore?"))
            # the state its strict turn stored: all of it, or all but the last generated token if the node
            # died before its write-behind stored that one (docs/operations.md, "Incremental states")
            assert out["cached_tokens"] in (prefix - 1, prefix), "continued from its stored state"
            fresh = generate(survivor.url, f"fresh-{slot}", ids).json()
            assert_same_greedy(fresh, out)
        for slot in staying:
            r = generate(proxy.url, slot, convs[slot])
            assert r.status_code == 200, r.text
