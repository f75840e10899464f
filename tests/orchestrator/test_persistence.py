"""Parking, durability and multi-node ownership with real stores (directory and redis-server)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import httpx

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import assert_same_greedy, iter_sse_events, tokenize
from tests.waiting import DEADLINE_S, wait_until

QUESTIONS = ["Name a red fruit.", "What is 3+4?", "Say hello in French.", "Name a planet.", "What colour is grass?",
             "Name a big cat."]  # fmt: skip


def gen(srv: ServerProc, slot: str, ids: list[int], n: int = 8) -> dict:  # type: ignore[type-arg]
    body = {"input_ids": ids, "max_new_tokens": n, "temperature": 0, "ignore_eos": True, "id_slot": slot, "n_probs": 5}
    r = httpx.post(srv.url + "/api/v1/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def toks(out: dict) -> list[int]:  # type: ignore[type-arg]
    return [t["token_id"] for t in out["generated_tokens"]]


def listing(srv: ServerProc) -> dict[object, dict]:  # type: ignore[type-arg]
    return {s["id"]: s for s in httpx.get(srv.url + "/slots", timeout=60).json()}


def saved(srv: ServerProc, slot: object) -> dict | None:  # type: ignore[type-arg]
    """The slot's listing once the store holds its current state, else None."""
    s = listing(srv).get(slot)
    return s if s and s.get("stored") and not s.get("dirty") else None


def wait_saved(srv: ServerProc, slot: object, timeout: float = DEADLINE_S) -> dict:  # type: ignore[type-arg]
    return wait_until(lambda: saved(srv, slot), f"slot {slot} persisted", timeout, interval=0.1)


def healthy(srv: ServerProc) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(srv.url + "/health", timeout=10).status_code == 200
    return False


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_parking_six_conversations_on_two_sequences(start_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = start_server("--parallel", "2", "--ctx-size", "1024", "--state-dir", str(tmp_path / "st"))
    prompts = [tokenize(srv.url, CHAT.format(q)) for q in QUESTIONS]
    # alone: each conversation's two turns, one conversation at a time
    alone = []
    for i, p in enumerate(prompts):
        t1 = gen(srv, f"solo{i}", p)
        t2 = gen(srv, f"solo{i}", p + toks(t1) + tokenize(srv.url, "\nWhy?"))
        alone.append((t1, t2))
    # interleaved: turn 1 of all six (each parks an older one), then turn 2 of all six
    first = [gen(srv, f"c{i}", p) for i, p in enumerate(prompts)]
    places = listing(srv)
    assert sum(1 for i in range(6) if places[f"c{i}"]["place"] == "resident") <= 2
    assert sum(1 for i in range(6) if places[f"c{i}"]["place"] == "parked") >= 4
    second = [gen(srv, f"c{i}", p + toks(first[i]) + tokenize(srv.url, "\nWhy?")) for i, p in enumerate(prompts)]
    for i in range(6):
        if assert_same_greedy(alone[i][0], first[i]) == 8 and toks(first[i]) == toks(alone[i][0]):
            assert_same_greedy(alone[i][1], second[i])  # same context: same continuation
        # a parked conversation came back with its cache: only the new message was prefilled
        assert second[i]["cached_tokens"] == len(prompts[i]) + 8, i
    parked = [s for s in listing(srv).values() if s["place"] == "parked"]
    assert parked and all(s["stored_bytes"] > 0 and s["state_bytes"] >= s["stored_bytes"] for s in parked), [
        (s["stored_bytes"], s["state_bytes"]) for s in parked
    ]


def test_slot_api_on_parked_slots(start_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = start_server("--parallel", "1", "--ctx-size", "1024", "--state-dir", str(tmp_path / "st"))
    p = tokenize(srv.url, CHAT.format("Name a red fruit."))
    out = gen(srv, "p1", p)
    wait_saved(srv, "p1")
    gen(srv, "p2", p)  # parks p1
    assert listing(srv)["p1"]["place"] == "parked"
    want = p + toks(out)
    r = httpx.post(srv.url + "/slots/p1", params={"action": "tokens"}, timeout=60).json()
    assert r["tokens"] == want
    assert listing(srv)["p1"]["place"] == "parked", "reading tokens must not restore the slot"
    blob = httpx.post(
        srv.url + "/slots/p1",
        params={"action": "save-state"},
        headers={"Accept": "application/octet-stream"},
        timeout=60,
    )
    assert blob.status_code == 200 and blob.content[:4] == b"SES1"
    info = httpx.get(srv.url + "/v1/slots/p1/info", timeout=60).json()
    assert info["n_tokens"] == len(want)
    pv = httpx.post(srv.url + "/api/v1/generate/preview", json={"append_tokens": tokenize(srv.url, "\nMore?"),
                                                                 "id_slot": "p1", "max_tokens": 4, "temperature": 0}, timeout=60)  # fmt: skip
    assert pv.status_code == 200 and pv.json()["cache_hit"] is True
    fk = httpx.post(srv.url + "/slots/p1", params={"action": "fork"}, json={"target": "p1-copy"}, timeout=60)
    assert fk.status_code == 200 and fk.json()["n_tokens"] == len(want), fk.text
    cs = httpx.post(
        srv.url + "/slots/p2", params={"action": "context-shift"}, json={"n_keep": 2, "n_discard": 3}, timeout=60
    )
    assert cs.status_code == 200 and cs.json()["new_n_tokens"] == len(want) - 3
    assert httpx.post(srv.url + "/slots/p1", params={"action": "tokens"}, timeout=60).json()["tokens"] == want


def test_restart_resumes_conversations(start_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """kill -9 the server after a completed turn; a new server continues with identical tokens."""
    args = ("--parallel", "2", "--ctx-size", "1024", "--state-dir", str(tmp_path / "st"))
    srv = start_server(*args)
    p = tokenize(srv.url, CHAT.format("What is 3+4?"))
    t1 = gen(srv, "r1", p)
    follow = p + toks(t1) + tokenize(srv.url, "\nAnd 5+6?")
    gen(srv, "r-control", p)  # the control conversation: same turns, never restarted
    control2 = gen(srv, "r-control", follow)
    wait_saved(srv, "r1")
    worker = srv.worker_pid()
    srv.stop(signal.SIGKILL)
    # the orphaned worker follows its parent (PR_SET_PDEATHSIG)
    wait_until(lambda: gone(worker), "the worker ends with its orchestrator", interval=0.1)
    srv2 = start_server(*args)
    assert listing(srv2)["r1"]["place"] == "parked"
    t2 = gen(srv2, "r1", follow)
    assert t2["cached_tokens"] == len(p) + 8, "restored from the store, not re-prefilled"
    assert_same_greedy(control2, t2)


def test_worker_crash_is_survived(start_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = start_server("--parallel", "2", "--ctx-size", "1024", "--state-dir", str(tmp_path / "st"))
    p = tokenize(srv.url, CHAT.format("Name a planet."))
    t1 = gen(srv, "w1", p)
    wait_saved(srv, "w1")
    follow = p + toks(t1) + tokenize(srv.url, "\nAnother?")
    events: list[dict] = []  # type: ignore[type-arg]

    def stream() -> None:
        events.extend(iter_sse_events(srv.url, {"input_ids": p, "max_new_tokens": 900, "temperature": 0,
                                                "ignore_eos": True, "id_slot": "w2", "output_attentions": True}))  # fmt: skip

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: events, "the stream's first token")  # the generation runs: kill its worker mid-way
    assert events[0]["type"] != "error", events
    os.kill(srv.worker_pid(), signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the stream did not end"
    assert events[-1]["type"] == "error" and events[-1]["error_code"] == "NO_MODEL", events[-1]
    wait_until(lambda: healthy(srv), "a new worker serves", interval=0.3)
    t2 = gen(srv, "w1", follow)
    assert t2["cached_tokens"] == len(p) + 8, "slot w1 came back from the store"


def test_foreign_fingerprint_is_refused(start_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from storage.directory import DirectoryStore
    from storage.slot_codec import save_slot

    state = tmp_path / "st"
    srv = start_server("--parallel", "2", "--ctx-size", "1024", "--state-dir", str(state))
    p = tokenize(srv.url, CHAT.format("Hi"))
    gen(srv, "mine", p)
    blob = httpx.post(
        srv.url + "/slots/mine", params={"action": "save-state"}, headers={"Accept": "application/octet-stream"}
    ).content
    ids = httpx.post(srv.url + "/slots/mine", params={"action": "tokens"}).json()["tokens"]
    asyncio.run(save_slot(DirectoryStore(state), "alien", "another-model-fingerprint", ids, blob))
    r = httpx.post(srv.url + "/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 2, "id_slot": "alien"})
    assert r.status_code == 400 and r.json()["error_code"] == "BAD_STATE", r.text
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_redis_store_outage_and_restart(start_server, own_redis, tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = (
        "--parallel",
        "2",
        "--ctx-size",
        "1024",
        "--redis-url",
        own_redis.url,
        "--key-prefix",
        "t1:",
        "--node-id",
        "node-r",
        "--durability",
        "write-behind",  # answers turns while the store is down and writes them when it is back
    )  # the restarted node is the same node: it takes its leases back
    srv = start_server(*args)
    p = tokenize(srv.url, CHAT.format("Name a big cat."))
    t1 = gen(srv, "rd1", p)
    wait_saved(srv, "rd1")
    gen(srv, "rd2", p)
    gen(srv, "rd3", p)  # parks rd1 into Redis
    assert listing(srv)["rd1"]["place"] == "parked"
    own_redis.stop()
    # resident slots keep generating; the turn is kept for later
    t3 = gen(srv, "rd3", p + tokenize(srv.url, "\nOk"))
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "degraded" and health["store"] == "unavailable"
    r = httpx.post(srv.url + "/api/v1/generate", json={"input_ids": p, "max_new_tokens": 2, "id_slot": "rd1"})
    assert r.status_code == 503 and r.json()["error_code"] == "STORE_UNAVAILABLE"
    own_redis.start()

    def store_back() -> bool:
        httpx.get(srv.url + "/slots")
        return httpx.get(srv.url + "/health").json()["status"] == "ok"

    wait_until(store_back, "the store is back", interval=0.5)
    wait_saved(srv, "rd3")  # the turn completed during the outage was written after it
    t1b = gen(srv, "rd1", p + toks(t1) + tokenize(srv.url, "\nWhy?"))
    assert t1b["cached_tokens"] == len(p) + 8
    srv.stop(signal.SIGKILL)
    srv2 = start_server(*args)
    out = httpx.post(srv2.url + "/slots/rd3", params={"action": "tokens"}).json()
    assert "tokens" in out, out
    assert out["tokens"] == p + tokenize(srv2.url, "\nOk") + toks(t3), "no completed turn lost"


def test_two_nodes_one_redis(start_server, redis_server) -> None:  # type: ignore[no-untyped-def]
    common = ("--parallel", "2", "--ctx-size", "1024", "--redis-url", redis_server.url, "--key-prefix", "pair:")
    a = start_server(*common, "--node-id", "node-a")
    b = start_server(*common, "--node-id", "node-b")
    p = tokenize(a.url, CHAT.format("Say hello in French."))
    t1 = gen(a, "shared", p)
    wait_saved(a, "shared")
    r = httpx.post(b.url + "/api/v1/generate", json={"input_ids": p, "max_new_tokens": 2, "id_slot": "shared"})
    assert r.status_code == 409 and r.json()["error_code"] == "SLOT_BUSY" and r.json()["owner"] == "node-a"
    a.stop()  # graceful: flushes and releases its leases
    follow = p + toks(t1) + tokenize(b.url, "\nThanks")
    r = gen(b, "shared", follow, n=4)
    assert r["cached_tokens"] == len(p) + 8, "node b resumed node a's conversation from Redis"


def test_crashed_node_conversation_moves_to_another_node(start_server, redis_server) -> None:  # type: ignore[no-untyped-def]
    """kill -9 a node; a node on another port (another node id) serves its conversation within seconds."""
    common = ("--parallel", "2", "--ctx-size", "1024", "--redis-url", redis_server.url, "--key-prefix", "crash:")
    a = start_server(*common)
    p = tokenize(a.url, CHAT.format("Name a planet."))
    t1 = gen(a, "moving", p)
    follow = p + toks(t1) + tokenize(a.url, "\nAnd another one?")
    gen(a, "moving-control", p)
    control2 = gen(a, "moving-control", follow)
    wait_saved(a, "moving")
    a.stop(signal.SIGKILL)  # its leases stay in Redis until they lapse
    b = start_server(*common)
    assert b.port != a.port
    body = {"input_ids": follow, "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "id_slot": "moving",
            "n_probs": 5}  # fmt: skip

    def served() -> httpx.Response | None:
        r = httpx.post(b.url + "/api/v1/generate", json=body, timeout=180)
        if r.status_code != 409:
            return r
        assert r.json()["error_code"] == "SLOT_BUSY" and r.json()["owner"].endswith(f":{a.port}")
        assert int(r.headers["Retry-After"]) >= 1
        return None

    r = wait_until(served, "the dead node's lease lapses", interval=0.5)
    assert r.status_code == 200, r.text
    t2 = r.json()
    assert t2["cached_tokens"] == len(p) + 8, "resumed from Redis, not re-prefilled"
    assert_same_greedy(control2, t2)
