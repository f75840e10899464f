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
    return start_server("--parallel", "2", "--ctx-size", "1024", "--redis-url", redis.url, *extra)


def _timed_gen(srv: ServerProc, slot: str, ids: list[int]) -> tuple[dict, float]:  # type: ignore[type-arg]
    t0 = time.monotonic()
    out = gen(srv, slot, ids, n=4)
    return out, time.monotonic() - t0


def test_stalled_background_save_does_not_hold_the_slot(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    # A long store deadline: a save that held the slot's lock would block the next turn for ~15-20 s
    # (redis-py's own socket timeouts), far beyond the 8 s bound below.
    srv = _server(start_server, own_redis, "--store-timeout", "20")
    ids = tokenize(srv.url, CHAT.format("Name a big cat."))
    ids += toks(gen(srv, "talk", ids, n=4))
    wait_saved(srv, "talk")
    own_redis.pause()
    try:
        ids += toks(gen(srv, "talk", ids, n=4))  # its write-behind save starts and hangs in Redis
        time.sleep(1.0)
        out, took = _timed_gen(srv, "talk", ids)
        assert took < 8, f"the turn waited {took:.1f} s for a stalled background save"
        ids += toks(out)
    finally:
        own_redis.resume()
    saved = wait_saved(srv, "talk", timeout=60)  # written once Redis answers again
    assert saved["n_tokens"] == len(ids)


def test_new_slot_fails_fast_while_resident_ones_generate(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    srv = _server(start_server, own_redis, "--store-timeout", "2")
    ids = tokenize(srv.url, CHAT.format("What is 3+4?"))
    ids += toks(gen(srv, "resident", ids, n=4))
    wait_saved(srv, "resident")
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
        out, took = _timed_gen(srv, "resident", ids)  # resident slots keep generating
        assert took < 10 and len(out["generated_tokens"]) == 4
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
