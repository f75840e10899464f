"""Two slotserve nodes (real engine, real model) on one redis-server started by the test.

A conversation moves between nodes only through the store and its lease: a node never serves a
slot empty that another node filled, never overwrites the state a newer owner wrote (the lease
token fences every write, :mod:`storage.redis_store`), and a continuation after a move equals a
fresh prefill's greedy tokens.  ``--parallel 1``: a node's next other conversation parks the
previous one (saving it and releasing its lease), which is how a conversation is handed on here.
Figures (takeover time after kill -9) are printed (``pytest -s``), never asserted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable

import httpx

from storage.redis_store import RedisStore
from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import assert_same_greedy, tokenize
from tests.orchestrator.test_persistence import gen, toks
from tests.redis_server import RedisServer

LEASE_MS = 1500


def node(start_server: Callable[..., ServerProc], redis: RedisServer, name: str, *extra: str) -> ServerProc:
    """A one-sequence node ``name`` on ``redis`` (prefix ``mn:``, lease ``LEASE_MS``)."""
    return start_server(
        "--parallel", "1", "--ctx-size", "1024", "--redis-url", redis.url, "--key-prefix", "mn:",
        "--node-id", name, "--lease-ms", str(LEASE_MS), *extra,
    )  # fmt: skip


def post(srv: ServerProc, slot: str, ids: list[int], n: int = 8) -> httpx.Response:
    body = {"input_ids": ids, "max_new_tokens": n, "temperature": 0, "ignore_eos": True, "id_slot": slot, "n_probs": 5}
    return httpx.post(srv.url + "/api/v1/generate", json=body, timeout=180)


def tokens_of(srv: ServerProc, slot: str) -> list[int]:
    r = httpx.post(srv.url + "/slots/" + slot, params={"action": "tokens"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def stored(redis: RedisServer, slot: str, prefix: str = "mn:") -> tuple[int, list[int]] | None:
    """``(generation, tokens)`` of the slot's state in Redis, read by the test itself."""

    async def read() -> tuple[int, list[int]] | None:
        store = RedisStore.from_url(redis.url, prefix=prefix)
        try:
            meta = await store.get_meta(slot)
        finally:
            await store.close()
        return None if meta is None else (meta.generation, list(meta.tokens))

    return asyncio.run(read())


def until_stored(redis: RedisServer, slot: str, want: list[int], timeout_s: float = 30.0) -> None:
    """Wait until the slot's stored tokens are ``want``: a strict commit stores all but the last
    generated token, whose KV write is pending; the write-behind it schedules stores that token
    ``--write-delay-ms`` later (docs/operations.md, "Incremental states")."""
    deadline = time.monotonic() + timeout_s
    while (got := stored(redis, slot)) is None or got[1] != want:
        assert got is None or got[1] == want[: len(got[1])], "the store holds another conversation"
        assert time.monotonic() < deadline, f"stored {None if got is None else len(got[1])} of {len(want)} tokens"
        time.sleep(0.05)


def park(srv: ServerProc, prompt: list[int]) -> None:
    """Park the node's resident conversation (its one sequence goes to a filler conversation)."""
    gen(srv, f"filler-{time.monotonic_ns()}", prompt, n=1)


def metric(srv: ServerProc, name: str) -> float:
    """A counter's value from the node's ``/metrics``."""
    for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def reference(srv: ServerProc, ids: list[int], n: int = 8) -> dict:  # type: ignore[type-arg]
    """The greedy continuation of ``ids`` prefilled from nothing (a fresh slot)."""
    return gen(srv, f"fresh-{time.monotonic_ns()}", ids, n=n)


def until_served(srv: ServerProc, slot: str, ids: list[int], n: int = 8) -> tuple[dict, int, float]:  # type: ignore[type-arg]
    """Ask until the node serves the slot (another node's lease lapses): the answer, the 409s seen
    before it, and when (``time.monotonic()``) the request that was served was sent."""
    refusals = 0
    while True:
        sent = time.monotonic()
        r = post(srv, slot, ids, n)
        if r.status_code != 409:
            assert r.status_code == 200, r.text
            return r.json(), refusals, sent
        assert r.json()["error_code"] == "SLOT_BUSY" and int(r.headers["Retry-After"]) >= 1
        refusals += 1
        assert refusals < 200, "the lease never lapsed"
        time.sleep(0.1)


def test_a_conversation_alternated_between_nodes_is_never_served_empty(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    """Node b is refused the slot before a's first save (a writes only when it parks); each later turn
    lands on the other node, which continues from the stored state (the full context cached)."""
    a = node(start_server, own_redis, "node-a", "--durability", "write-behind", "--write-delay-ms", "60000")
    b = node(start_server, own_redis, "node-b")
    p = tokenize(a.url, CHAT.format("Name a planet."))
    ids = p + toks(gen(a, "alt", p))
    r = post(b, "alt", ids + tokenize(b.url, "\nWhy?"))
    assert r.status_code == 409 and r.json()["owner"] == "node-a"
    assert stored(own_redis, "alt") is None, "the scenario needs b's refusal before a's first save"
    park(a, p)
    last_gen = 0
    for turn, srv in enumerate([b, a, b]):
        assert tokens_of(srv, "alt") == ids, f"turn {turn}: the node sees the stored conversation"
        ids = ids + tokenize(srv.url, "\nAnother one?")
        out = gen(srv, "alt", ids)
        assert out["cached_tokens"] == len(ids) - len(tokenize(srv.url, "\nAnother one?")), "restored, not empty"
        assert_same_greedy(reference(srv, ids), out)
        ids = ids + toks(out)
        park(srv, p)
        gen_now, stored_ids = stored(own_redis, "alt")  # type: ignore[misc]
        assert stored_ids == ids and gen_now > last_gen, f"turn {turn}: stored, and never went back"
        last_gen = gen_now


def test_both_nodes_at_once_one_owner_and_the_other_follows_it(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    a = node(start_server, own_redis, "node-a")
    b = node(start_server, own_redis, "node-b")
    p = tokenize(a.url, CHAT.format("Say hello in French."))
    answers: dict[str, httpx.Response] = {}
    go = threading.Barrier(2)

    def hit(srv: ServerProc, name: str) -> None:
        go.wait()
        answers[name] = post(srv, "both", p)

    threads = [threading.Thread(target=hit, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    codes = sorted(r.status_code for r in answers.values())
    assert codes == [200, 409], {k: r.text for k, r in answers.items()}
    for name, r in answers.items():
        if r.status_code == 409:
            assert r.json()["error_code"] == "SLOT_BUSY" and r.json()["owner"] == (
                "node-b" if name == "a" else "node-a"
            )
    winner = a if answers["a"].status_code == 200 else b
    loser = b if winner is a else a
    ids = p + toks(answers["a" if winner is a else "b"].json())
    park(winner, p)
    assert tokens_of(loser, "both") == ids, "the other node serves the winner's state, not an empty slot"
    follow = ids + tokenize(loser.url, "\nMerci!")
    out = gen(loser, "both", follow)
    assert out["cached_tokens"] == len(ids)
    assert_same_greedy(reference(loser, follow), out)


def test_kill_9_of_the_owner_moves_the_conversation_with_every_answered_turn(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    """Strict durability (the default): a turn answered just before the kill is in the store; the
    other node takes the conversation once the lease lapses."""
    a = node(start_server, own_redis, "node-a")
    b = node(start_server, own_redis, "node-b")
    p = tokenize(a.url, CHAT.format("What is 3+4?"))
    ids = p + toks(gen(a, "kill", p))
    ids += tokenize(a.url, "\nAnd 5+6?")
    ids += toks(gen(a, "kill", ids))
    a.stop(signal.SIGKILL)  # at once: no graceful flush, the lease stays until it lapses
    t0 = time.monotonic()
    follow = ids + tokenize(b.url, "\nThanks")
    out, refusals, sent = until_served(b, "kill", follow)
    print(
        f"\ntakeover after kill -9: the other node accepted the conversation {sent - t0:.2f} s after the kill"
        f" ({refusals} x 409 first; lease {LEASE_MS} ms); that turn answered {time.monotonic() - t0:.2f} s after it"
    )
    # The strict commit stores every answered token but the last generated one, whose KV write was
    # pending (its write-behind may not have run before the kill): the new owner re-prefills at most it.
    assert out["cached_tokens"] in (len(ids), len(ids) - 1), "every answered turn was in the store"
    assert_same_greedy(reference(b, follow), out)


def test_a_paused_owner_cannot_overwrite_the_new_owner(
    start_server: Callable[..., ServerProc], own_redis: RedisServer
) -> None:
    """SIGSTOP node a past its lease with a turn not yet written; b takes the conversation; SIGCONT: a's
    write is refused (counted), b's state stays, and a later serves b's state."""
    a = node(start_server, own_redis, "node-a", "--durability", "write-behind", "--write-delay-ms", "1000")
    b = node(start_server, own_redis, "node-b")
    p = tokenize(a.url, CHAT.format("Name a big cat."))
    ids = p + toks(gen(a, "pause", p))
    while stored(own_redis, "pause") is None:  # a's write-behind stores turn 1
        time.sleep(0.1)
    stale = ids + tokenize(a.url, "\nWhy?")
    gen(a, "pause", stale)  # turn 2 on a: answered, its write due in 1 s
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        follow = ids + tokenize(b.url, "\nAnother?")
        out_b, _, _ = until_served(b, "pause", follow)  # once a's lease lapsed: b continues from turn 1
        assert out_b["cached_tokens"] == len(ids)
        b_ids = follow + toks(out_b)
        until_stored(own_redis, "pause", b_ids)  # b's commit, then its write-behind of the last token
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    while metric(a, "slotserve_stale_writes_refused_total") < 1:  # a's late write-behind runs, and is refused
        time.sleep(0.1)
    assert stored(own_redis, "pause")[1] == b_ids, "the stale node overwrote nothing"  # type: ignore[index]
    r = post(a, "pause", stale)
    assert r.status_code == 409 and r.json()["owner"] == "node-b"
    assert_same_greedy(reference(b, follow), out_b)  # (its fresh slot parks the conversation: b lets go)
    assert tokens_of(a, "pause") == b_ids, "a serves b's state, not its own stale copy"
    again = b_ids + tokenize(a.url, "\nOk.")
    out = gen(a, "pause", again)
    assert out["cached_tokens"] == len(b_ids)
    assert_same_greedy(reference(a, again), out)
    until_stored(own_redis, "pause", again + toks(out))
