"""A stalled store (redis-server paused with SIGSTOP) holds no slot: resident slots keep generating,
a request that needs the store gets a clear 503 quickly, and everything is saved once it answers.

Time bounds here only detect a hang: they are several times what the step takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import tokenize
from tests.orchestrator.test_persistence import gen, listing, toks, wait_saved
from tests.redis_server import RedisServer


def _server(start_server: Callable[..., ServerProc], redis: RedisServer, *extra: str) -> ServerProc:
    """A node that answers turns without waiting for the store (``--durability write-behind``): with
    ``strict`` a turn cannot be answered while the store is stalled, by design."""
    args = ("--parallel", "2", "--ctx-size", "1024", "--redis-url", redis.url, "--durability", "write-behind")
    return start_server(*args, *extra)


def _waited(srv: ServerProc, slot: str, ids: list[int]) -> tuple[dict, float]:  # type: ignore[type-arg]
    """A 4-token turn, and how long it waited before generating: its wall time minus the server's
    ``generation_time_ms`` (which starts once the slot is held), so a slow CPU does not count."""
    t0 = time.monotonic()
    out = gen(srv, slot, ids, n=4)
    return out, time.monotonic() - t0 - out["generation_time_ms"] / 1000


def _talking(srv: ServerProc, slot: str, question: str) -> list[int]:
    """A saved first turn on ``slot``; returns its tokens."""
    ids = tokenize(srv.url, CHAT.format(question))
    ids += toks(gen(srv, slot, ids, n=4))
    wait_saved(srv, slot)
    return ids


def test_stalled_background_save_does_not_hold_the_slot(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    # A long store deadline: a save that held the slot's lock would make the next turn wait ~15-20 s
    # (redis-py's own socket timeouts), far beyond the 5 s bound below.
    srv = _server(start_server, own_redis, "--store-timeout", "20")
    ids = _talking(srv, "talk", "Name a big cat.")
    own_redis.pause()
    try:
        ids += toks(gen(srv, "talk", ids, n=4))  # its write-behind save starts and hangs in Redis
        time.sleep(1.0)
        out, waited = _waited(srv, "talk", ids)
        assert waited < 5, f"the turn waited {waited:.1f} s for a stalled background save"
        ids += toks(out)
    finally:
        own_redis.resume()
    saved = wait_saved(srv, "talk", timeout=60)  # written once Redis answers again
    assert saved["n_tokens"] == len(ids)


def test_new_slot_fails_fast_while_resident_ones_generate(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    srv = _server(start_server, own_redis, "--store-timeout", "2")
    ids = _talking(srv, "resident", "What is 3+4?")
    own_redis.pause()
    try:
        for attempt in range(2):  # the first waits for the store deadline, the second not even that
            t0 = time.monotonic()
            r = httpx.post(
                srv.url + "/api/v1/generate",
                json={"input_ids": ids, "max_new_tokens": 2, "id_slot": "fresh"},
                timeout=60,
            )
            took = time.monotonic() - t0
            assert r.status_code == 503, r.text
            assert r.json()["error_code"] == "STORE_UNAVAILABLE"
            assert took < 10, f"attempt {attempt}: the 503 took {took:.1f} s"
        out, waited = _waited(srv, "resident", ids)  # resident slots keep generating
        assert waited < 5 and len(out["generated_tokens"]) == 4
        ids += toks(out)
        assert httpx.get(srv.url + "/health", timeout=30).json()["store"] == "unavailable"
    finally:
        own_redis.resume()
    deadline = time.monotonic() + 30
    while True:  # the store is back: the new slot works and the resident one gets saved
        r = httpx.post(
            srv.url + "/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 2, "id_slot": "fresh"}, timeout=60
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert wait_saved(srv, "resident", timeout=60)["n_tokens"] == len(ids)
    assert listing(srv)["fresh"]["place"] == "resident"
