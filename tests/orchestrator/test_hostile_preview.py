"""Previews with nothing to append, and previews whose client leaves (issue 13, found 1)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import assert_same_greedy, tokenize
from tests.waiting import wait_until


def gen(server: ServerProc, slot: str, ids: list[int], n: int) -> dict:  # type: ignore[type-arg]
    body = {"input_ids": ids, "max_new_tokens": n, "temperature": 0, "ignore_eos": True, "id_slot": slot, "n_probs": 5}
    r = httpx.post(server.url + "/api/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def slot_tokens(server: ServerProc, slot: str) -> list[int]:
    r = httpx.post(f"{server.url}/slots/{slot}", params={"action": "tokens"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def main_thread(pid: int) -> tuple[str, int]:
    """State letter (``S``: asleep) and user + system CPU clock ticks of a process's main thread
    (``/proc/PID/task/PID/stat`` fields 3, 14 and 15, proc(5))."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


def test_preview_with_nothing_to_append_matches_a_generation(server: ServerProc) -> None:
    ids = tokenize(server.url, CHAT.format("Name three birds."))
    gen(server, "pv-empty", ids, n=4)
    held = slot_tokens(server, "pv-empty")
    # append_tokens defaults to []: the fork decodes the slot's last token again for its logits
    r = httpx.post(
        server.url + "/api/v1/generate/preview",
        json={"conversation_id": "pv-empty", "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["cache_hit"] is True and p["n_prefilled"] == 1 and p["n_cached"] == len(held) - 1
    assert slot_tokens(server, "pv-empty") == held  # the slot is untouched
    # the same continuation as a normal greedy generation from the slot's tokens
    ref = gen(server, "pv-empty-ref", held, n=6)
    assert assert_same_greedy(ref, {"generated_tokens": p["tokens"]}) >= 1
    assert len(p["tokens"]) == 6 or p["stopped_reason"] == "stop_token"


def test_preview_with_only_input_ids_on_a_cached_slot(server: ServerProc) -> None:
    # schemathesis' case: slot "0" holds tokens, the body names only input_ids
    gen(server, "0", tokenize(server.url, CHAT.format("Hi")), n=2)
    r = httpx.post(server.url + "/api/v1/generate/preview", json={"input_ids": [0]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["cache_hit"] is True and r.json()["token_count"] >= 1


def test_idle_worker_blocks(server: ServerProc) -> None:
    """After previews with nothing to append the worker has no work: it must sleep, not spin."""
    for _ in range(2):
        r = httpx.post(
            server.url + "/api/v1/generate/preview", json={"conversation_id": "0", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200, r.text
    pid = server.worker_pid()
    asleep: list[int] = []  # CPU ticks of consecutive observations of the main thread asleep

    def asleep_for_a_while() -> bool:
        state, ticks = main_thread(pid)
        if state != "S" or asleep[-1:] not in ([], [ticks]):
            asleep.clear()  # running (a spinning loop is never seen asleep twice with the same CPU time)
        if state == "S":
            asleep.append(ticks)
        return len(asleep) >= 20

    # once the write-behind save is done the worker waits in its inbox: asleep, its CPU time still
    wait_until(asleep_for_a_while, "the idle worker's main thread blocks")


@pytest.fixture(scope="module")
def one_spare(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("one-spare")
    srv = ServerProc(
        ["--threads", "2", "--parallel", "1", "--spare", "1", "--ctx-size", "1024", "--state-dir", str(work / "s")],
        work,
    ).start()
    yield srv
    srv.stop()


def test_preview_is_cancelled_when_its_client_leaves(one_spare: ServerProc) -> None:
    srv = one_spare
    ids = tokenize(srv.url, CHAT.format("Write a very long story about a dragon who learns to bake bread."))
    body = {"input_ids": ids, "max_tokens": 256, "temperature": 0, "use_cached_context": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/api/v1/generate/preview", json=body, timeout=1.0)
    # The only spare sequence is free again within a few decode steps, long before 256 tokens.
    quick = {**body, "max_tokens": 1}

    def served() -> httpx.Response | None:
        r = httpx.post(srv.url + "/api/v1/generate/preview", json=quick, timeout=60)
        return None if r.status_code == 429 else r

    r = wait_until(served, "the spare sequence is free again", interval=0.1)
    assert r.status_code == 200, r.text
    log = srv.log()
    assert "preview done" in log and "cancelled" in log, log[-2000:]
