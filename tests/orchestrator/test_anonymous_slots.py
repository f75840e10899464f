"""Requests without a slot id (docs/api.md, "Requests without a slot id"): each finds the slot whose
cache shares the longest prefix with its prompt (llama-server's ``--slot-prompt-similarity``), takes
over the anonymous slot it continues, forks a named one, and reports the slot in ``X-Slot-Id``.

The real model on a real server with ``--parallel 2``; concurrent users are threads.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.slots.anonymous import Candidate, _bytes, common_prefix, contains, continues, is_anonymous, pick
from orchestrator.web.slot_header import header_value
from tests.conftest import CHAT, ServerProc
from tests.orchestrator.client import tokenize

SYSTEM = (
    "<|im_start|>system\n" + "You are a patient tutor who answers in short, plain sentences. " * 12 + "<|im_end|>\n"
)
QUESTIONS = {
    "A": ["Tell me about owls.", "What do they eat?", "Where do they nest?"],
    "B": ["Explain the tides.", "Why are there two a day?", "What is a spring tide?"],
}
N_GEN = 16
TURNS: dict[str, list[dict[str, Any]]] = {}  # per API, each user's turns, for the figures below


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work: Path = tmp_path_factory.mktemp("anon")
    s = ServerProc(["--threads", "2", "--parallel", "2", "--ctx-size", "2048", "--verify-cells"], work).start()
    yield s
    s.stop()


def test_prefix_and_pick_rules() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert common_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([7] * 1000 + [1], [7] * 1000 + [2]) == 1000
    assert contains(_bytes([5, 1, 2, 3]), [1, 2]) and not contains(_bytes([1, 3, 2]), [1, 2])
    assert not contains(_bytes([1 << 8]), [1])
    ids = list(range(100))
    named = Candidate("sys", list(range(40)), False)
    mine = Candidate("anon-a", list(range(100)), True)  # the prompt continues it
    other = Candidate("anon-b", list(range(40)) + [555] * 200, True)  # shares only the system prompt
    p = pick([*ids, 7], [named, mine, other], 0.1)
    assert p is not None and (p.slot_id, p.lcp, p.take_over) == ("anon-a", 100, True)
    p = pick(ids, [named, other], 0.1)  # equal prefixes: the smaller slot, a named one: forked
    assert p is not None and (p.slot_id, p.lcp, p.take_over) == ("sys", 40, False)
    p = pick(ids, [other], 0.1)  # another conversation's slot sharing a prefix: forked, not taken
    assert p is not None and (p.slot_id, p.take_over) == ("anon-b", False)
    assert pick(ids, [Candidate("c", [*range(10), 1], True)], 0.1) is None  # 10/100 is not > 0.1
    assert pick(ids, [], 0.1) is None
    # pruned in its middle right after a short prefix (similarity 5/330): still its own slot
    slot = list(range(1000, 1400))
    pruned = slot[:5] + slot[60:200] + slot[260:] + [7] * 40  # two chunks of 55 and 60 pruned
    p = pick(pruned, [Candidate("anon-d", slot, False), named], 0.1)
    assert p is not None and (p.slot_id, p.lcp, p.take_over) == ("anon-d", 5, True)
    # the slot's own last tokens are not in the prompt (the client keeps another reply), the rest is
    p = pick(pruned[:-40] + [3] * 40, [Candidate("anon-d", slot + [9] * 30, False)], 0.1)
    assert p is not None and p.take_over
    assert continues(list(range(50)), list(range(45)), 45)  # a re-tokenized end: 5 tokens short
    assert not continues(list(range(50)), list(range(30)), 30)  # a regenerated answer: forked
    # another client with the same long system text after another first token: not a continuation
    shared = list(range(2000, 2150))
    assert not continues([1, *shared, *range(3000, 3080)], [2, *shared, *range(4000, 4020)], 0)
    assert is_anonymous("anon-0123456789abcdef") and not is_anonymous("0")
    assert header_value("alice") == b"alice" and header_value("é 1") == b"%C3%A9 1"


def test_agent_step_with_its_answer_rewritten_continues() -> None:
    """An agent's next step (smolagents: the model's tool call sent back as ``Calling tools:`` text,
    then the tool's result) keeps every message of the slot but the model's latest answer: taken
    over, not forked, and so is no other conversation."""
    end = 2  # an end-of-generation token (the chat template's end of a message)
    system = [*range(100, 1300), end]
    prompt = [*system, *range(2000, 2030), end, 7, 8]  # system, task, the generation prompt
    slot = [*prompt, *range(5000, 5029)]  # and the model's answer (its final end token not decoded)
    step = [*prompt, *range(6000, 6040), end, *range(7000, 7020), end, 7, 8]  # answer rewritten, result
    assert continues(slot, step, len(prompt), {end})
    assert not continues(slot, step, len(prompt)), "without the model's end tokens: forked, as before"
    p = pick(step, [Candidate("anon-e", slot, True), Candidate("anon-f", system, True)], 0.1, {end})
    assert p is not None and (p.slot_id, p.lcp, p.take_over) == ("anon-e", len(prompt), True)
    assert not continues(slot, prompt, len(prompt), {end}), "a regenerated answer is forked"
    assert not continues(slot, [*prompt, 9, 9], len(prompt), {end}), "an edited answer, no new message"
    other = [*system, *range(2000, 2010), 3, end, 7, 8, 9, end]  # parts inside the slot's task message
    assert not continues(slot, other, common_prefix(slot, other), {end})
    no_chat = [*range(100, 1300), *range(5000, 5029)]  # a raw completion: no message ends at all
    assert not continues(no_chat, [*range(100, 1300), 4, end], 1200, {end})


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One Kobold SSE generation (Halo Weave's body: no slot id, aggregated attention): its
    ``X-Slot-Id``, ``done`` event, and when its first token and its end arrived."""
    out: dict[str, Any] = {"t0": time.monotonic()}
    with httpx.stream("POST", url + "/api/extra/generate/stream", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        out["slot"] = r.headers["x-slot-id"]
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            while "\n\n" in buf:
                frame, buf = buf.split("\n\n", 1)
                ev = json.loads("".join(line[6:] for line in frame.split("\n") if line.startswith("data: ")))
                if ev.get("type") == "token" and "t_first" not in out:
                    out["t_first"] = time.monotonic()
                    out["generated"] = []
                if ev.get("type") == "token":
                    out["generated"].append(ev["token"]["token_id"])
                elif ev.get("type") == "done":
                    out["done"], out["t_done"] = ev, time.monotonic()
    return out


def _kobold_turn(url: str, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "max_length": N_GEN, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "rep_pen": 1.0,
            "output_attentions": True, "attention_format": "aggregated", "request_id": "t", "sampler_seed": 7,
            "stop_sequence": ["<|im_start|>user"], "ignore_eos": True}  # fmt: skip
    got = _stream(url, body)
    d = got["done"]
    return {"slot": got["slot"], "prompt": len(ids), "cached": d["cached_tokens"], "done_slot": d["slot_id"],
            "generated": got["generated"], "t0": got["t0"], "t_first": got["t_first"], "t_done": got["t_done"]}  # fmt: skip


def _json_turn(url: str, ids: list[int]) -> dict[str, Any]:
    t0 = time.monotonic()
    body = {"input_ids": ids, "max_new_tokens": N_GEN, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/api/v1/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    b = r.json()
    return {"slot": r.headers["x-slot-id"], "prompt": len(ids), "cached": b["cached_tokens"],
            "done_slot": b["slot_id"], "generated": [t["token_id"] for t in b["generated_tokens"]],
            "t0": t0, "t_done": time.monotonic()}  # fmt: skip


def _concurrently(turn: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run ``turn(user)`` for both users at once (released together)."""
    gate = threading.Barrier(2)
    out: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(user: str) -> None:
        try:
            gate.wait()
            out[user] = turn(user)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(u,)) for u in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return out


def _conversations(srv: ServerProc, api: str, turn: Callable[[str, list[int]], dict[str, Any]]) -> None:
    """Two users continue their own conversations at once, three turns, sending their whole
    context each turn and no slot id; each keeps its own slot and finds its cache."""
    contexts = {u: tokenize(srv.url, SYSTEM) for u in QUESTIONS}
    history: dict[str, list[dict[str, Any]]] = {u: [] for u in QUESTIONS}
    for i in range(3):
        for u, qs in QUESTIONS.items():
            contexts[u] = contexts[u] + tokenize(srv.url, ("<|im_end|>\n" if i else "") + CHAT.format(qs[i]))
        got = _concurrently(lambda u: turn(srv.url, contexts[u]))
        for u, t in got.items():
            history[u].append(t)
            contexts[u] = contexts[u] + t["generated"]
    TURNS[api] = [t | {"user": u, "turn": i + 1} for u, ts in history.items() for i, t in enumerate(ts)]
    a, b = history["A"], history["B"]
    for user in (a, b):
        assert all(is_anonymous(t["slot"]) and str(t["done_slot"]) == t["slot"] for t in user)
        assert len({t["slot"] for t in user}) == 1, "a user's turns continue one slot"
        for prev, t in itertools.pairwise(user):
            assert t["cached"] == prev["prompt"] + len(prev["generated"]), "the whole previous turn is cached"
    assert a[0]["slot"] != b[0]["slot"], "each user has a slot of their own"
    if api == "kobold":  # both generated at the same time in every turn: neither waited for the other
        for x, y in zip(a, b, strict=True):
            assert x["t_first"] < y["t_done"] and y["t_first"] < x["t_done"], (x, y)


def test_two_users_kobold_stream(srv: ServerProc) -> None:
    _conversations(srv, "kobold", _kobold_turn)


def test_two_users_json_api(srv: ServerProc) -> None:
    _conversations(srv, "json", _json_turn)


def test_two_users_openai_without_user(srv: ServerProc) -> None:
    """OpenAI chat without ``user``: the messages are rendered by the chat template each turn."""
    history: dict[str, list[dict[str, Any]]] = {u: [] for u in QUESTIONS}
    messages: dict[str, list[dict[str, str]]] = {u: [{"role": "system", "content": SYSTEM[19:-11]}] for u in QUESTIONS}

    def turn(u: str) -> dict[str, Any]:
        body = {"model": "m", "messages": messages[u], "max_tokens": N_GEN, "temperature": 0}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        b = r.json()
        return {"slot": r.headers["x-slot-id"], "done_slot": b["slot_id"], "prompt": b["usage"]["prompt_tokens"],
                "cached": b["usage"]["prompt_tokens_details"]["cached_tokens"],
                "text": b["choices"][0]["message"]["content"]}  # fmt: skip

    for i in range(3):
        for u, qs in QUESTIONS.items():
            messages[u].append({"role": "user", "content": qs[i]})
        for u, t in _concurrently(turn).items():
            history[u].append(t)
            messages[u].append({"role": "assistant", "content": t["text"]})
    TURNS["openai"] = [t | {"user": u, "turn": i + 1} for u, ts in history.items() for i, t in enumerate(ts)]
    for user in history.values():
        assert len({t["slot"] for t in user}) == 1 and is_anonymous(user[0]["slot"])
        assert all(str(t["done_slot"]) == t["slot"] for t in user)
        for prev, t in itertools.pairwise(user):
            assert t["cached"] >= prev["prompt"], "the previous prompt at least (the answer is re-tokenized)"
    assert history["A"][0]["slot"] != history["B"][0]["slot"]
    earlier = {t["slot"] for api in ("kobold", "json") for t in TURNS.get(api, [])}
    assert not earlier & {t["slot"] for t in TURNS["openai"]}, "the same first turns forked, not taken over"


def _tokens(srv: ServerProc, slot: str) -> list[int]:
    r = httpx.post(f"{srv.url}/slots/{slot}", params={"action": "tokens"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]  # type: ignore[no-any-return]


def test_named_slot_is_forked_not_overwritten(srv: ServerProc) -> None:
    """A named slot holding a long system prompt: anonymous requests that start with it get forks
    (cached: the shared prefix), and the named slot stays exactly as it was."""
    system = tokenize(srv.url, SYSTEM.replace("patient tutor", "careful librarian"))
    r = httpx.post(
        srv.url + "/api/v1/generate", json={"input_ids": system, "max_new_tokens": 0, "id_slot": "library"}, timeout=120
    )
    assert r.status_code == 200 and r.headers["x-slot-id"] == "library", r.text
    before = _tokens(srv, "library")
    assert before == system
    seen = []
    for q in ("Where are the maps?", "How do I renew a book?"):
        ids = system + tokenize(srv.url, CHAT.format(q))
        got = _json_turn(srv.url, ids)
        seen.append(got)
        assert is_anonymous(got["slot"]) and got["cached"] >= len(system), got
    assert seen[0]["cached"] == len(system), "the first fork: the named slot's system prompt"
    TURNS["fork"] = [{"user": f"U{i + 1}", "turn": 1} | t for i, t in enumerate(seen)]
    assert seen[0]["slot"] != seen[1]["slot"]
    assert _tokens(srv, "library") == before, "the named slot is unchanged"
    # naming the slot still continues it, as before
    follow = before + tokenize(srv.url, CHAT.format("Hello"))
    r = httpx.post(
        srv.url + "/api/v1/generate", json={"input_ids": follow, "max_new_tokens": 2, "id_slot": "library"}, timeout=120
    )
    assert r.status_code == 200 and r.json()["cached_tokens"] == len(before) and r.json()["slot_id"] == "library"


def test_preview_without_slot_forks_the_latest_anonymous_slot(srv: ServerProc) -> None:
    """Halo Weave's preview names no slot: it forks the slot its last generation used."""
    ids = tokenize(srv.url, CHAT.format("Name three rivers."))
    got = _json_turn(srv.url, ids)
    append = tokenize(srv.url, "<|im_end|>\n" + CHAT.format("And lakes?"))
    r = httpx.post(srv.url + "/api/v1/generate/preview", json={"append_tokens": append, "max_tokens": 3}, timeout=300)
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["cache_hit"] is True and p["slot_id"] == got["slot"] and r.headers["x-slot-id"] == got["slot"]
    assert p["n_cached"] == len(ids) + len(got["generated"])
    assert _tokens(srv, got["slot"]) == ids + got["generated"], "the preview left the slot as it was"


def test_preview_forks_only_a_cache_of_its_own_salt(srv: ServerProc) -> None:
    """A preview with ``cache_salt`` forks the cache made with that salt (its session header's conversation,
    or the tenant's latest); without the salt, or with another, that cache is no candidate (400
    ``NO_CACHED_CONTEXT``: nothing to fork), and the salted slot is left as it was."""
    ids = tokenize(srv.url, CHAT.format("Name three mountains."))
    body = {"input_ids": ids, "max_new_tokens": 2, "temperature": 0, "ignore_eos": True, "cache_salt": "salt-p"}
    head = {"X-Session-Id": "preview-salted"}
    r = httpx.post(srv.url + "/api/v1/generate", json=body, headers=head, timeout=300)
    assert r.status_code == 200, r.text
    slot, n = r.headers["x-slot-id"], len(ids) + 2
    append = tokenize(srv.url, "<|im_end|>\n" + CHAT.format("And hills?"))
    preview = {"append_tokens": append, "max_tokens": 2}
    hit = httpx.post(srv.url + "/api/v1/generate/preview", json={**preview, "cache_salt": "salt-p"}, headers=head,
                     timeout=300)  # fmt: skip
    assert hit.status_code == 200 and hit.json()["cache_hit"] and hit.json()["n_cached"] == n, hit.text
    assert hit.json()["slot_id"] == slot
    for other in ({}, {"cache_salt": "salt-q"}):
        miss = httpx.post(srv.url + "/api/v1/generate/preview", json={**preview, **other}, headers=head, timeout=300)
        assert miss.status_code == 400 and miss.json()["error_code"] == "NO_CACHED_CONTEXT", (other, miss.text)
    assert len(_tokens(srv, slot)) == n, "the previews left the salted slot as it was"


def test_llama_server_completion_reports_the_chosen_slot(srv: ServerProc) -> None:
    prompt = "The lighthouse keeper climbed the stairs every evening to"
    first = httpx.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0}, timeout=300)
    assert first.status_code == 200, first.text
    slot = first.headers["x-slot-id"]
    assert is_anonymous(slot) and first.json()["id_slot"] == slot
    follow = prompt + first.json()["content"] + " and then"
    body = {"prompt": follow, "n_predict": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/completion", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["x-slot-id"] == slot
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert {c["id_slot"] for c in chunks} == {slot}
    assert chunks[-1]["timings"]["cache_n"] >= len(tokenize(srv.url, prompt))
    fresh = httpx.post(
        srv.url + "/completion", json={"prompt": follow, "n_predict": 2, "cache_prompt": False}, timeout=60
    )
    assert fresh.status_code == 200 and fresh.json()["id_slot"] != slot and fresh.json()["timings"]["cache_n"] == 0


def test_named_requests_unchanged_and_header_everywhere(srv: ServerProc) -> None:
    ids = tokenize(srv.url, CHAT.format("Count to three."))
    r = httpx.post(
        srv.url + "/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 2, "conversation_id": "é"}, timeout=60
    )
    assert r.status_code == 200 and r.json()["slot_id"] == "é" and r.headers["x-slot-id"] == "%C3%A9"
    o = httpx.post(
        srv.url + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2, "user": "bob"}, timeout=60
    )
    assert o.status_code == 200 and o.headers["x-slot-id"] == "bob" and o.json()["slot_id"] == "bob"
    bad = httpx.post(srv.url + "/api/v1/generate", json={"input_ids": [10**7], "max_new_tokens": 2}, timeout=300)
    assert bad.status_code == 400 and "x-slot-id" not in bad.headers


def test_figures() -> None:
    """Print the cached_tokens figures of the runs above (pytest -s shows them)."""
    for api, turns in TURNS.items():
        for t in sorted(turns, key=lambda t: (t["turn"], t["user"])):
            overlap = ""
            if "t_first" in t:
                overlap = f" first token {t['t_first'] - t['t0']:.2f} s, done {t['t_done'] - t['t0']:.2f} s"
            print(f"{api:7s} user {t['user']} turn {t['turn']}: slot {t['slot']} prompt {t['prompt']:4d}"
                  f" cached {t['cached']:4d}{overlap}")  # fmt: skip
    assert set(TURNS) <= {"kobold", "json", "openai", "fork"}


def test_similarity_zero_uses_slot_zero(start_server: Callable[..., ServerProc]) -> None:
    """``--slot-prompt-similarity 0`` turns matching off: slot "0", as before."""
    s = start_server("--slot-prompt-similarity", "0", "--parallel", "1", "--ctx-size", "512")
    ids = tokenize(s.url, CHAT.format("Hi"))
    body = {"input_ids": ids, "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(s.url + "/api/v1/generate", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["slot_id"] == 0 and r.headers["x-slot-id"] == "0"
    follow = ids + [t["token_id"] for t in r.json()["generated_tokens"]]
    r2 = httpx.post(s.url + "/api/v1/generate", json={**body, "input_ids": follow}, timeout=300)
    assert (
        r2.json()["slot_id"] == 0 and r2.json()["cached_tokens"] == len(follow) - 1
    )  # its last token is computed again


def test_anonymous_slots_are_bounded(start_server: Callable[..., ServerProc]) -> None:
    """``--anon-slots 2``: a third conversation deletes the least recently used anonymous slot."""
    s = start_server("--anon-slots", "2", "--parallel", "2", "--ctx-size", "512")
    slots = []
    for q in ("Apples?", "Pears?", "Plums?"):
        body = {"input_ids": tokenize(s.url, CHAT.format(q)), "max_new_tokens": 2}
        r = httpx.post(s.url + "/api/v1/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        slots.append(r.headers["x-slot-id"])
    assert len(set(slots)) == 3
    gone = httpx.post(f"{s.url}/slots/{slots[0]}", params={"action": "tokens"}, timeout=300)
    assert gone.status_code == 404 and gone.json()["error_code"] == "SLOT_NOT_FOUND"
    assert all(
        httpx.post(f"{s.url}/slots/{x}", params={"action": "tokens"}, timeout=300).status_code == 200 for x in slots[1:]
    )
