"""Agent clients that name no slot keep one slot per conversation (docs/api.md, "Requests without a
slot id"), through a real server on the real model:

* smolagents' ``ToolCallingAgent`` steps (the recorded request sequence in ``smolagents_steps.json``:
  prompts of 1,259-1,526 tokens, longer than a batch, no slot id, the model's tool calls sent back
  as smolagents renders them, ``Calling tools:\\n[...]``, followed by the tool's ``Observation``):
  every step continues the first step's slot and reuses all of the previous step's prompt;
* Claude Code's (``X-Claude-Code-Session-Id``, Anthropic's Messages API) and OpenCode's
  (``x-opencode-session``, OpenAI's Chat Completions) session headers of two tenants, interleaved
  for 10 turns with the same long system prompt: each keeps one slot, ``cached_tokens`` is at least
  95 % of each turn's prompt from the 2nd turn, and neither reuses the other's cache.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProc

STEPS = json.loads((Path(__file__).parent / "smolagents_steps.json").read_text())["request"]
KEYS = "key-a tenant-a\nkey-b tenant-b\nkey-agent tenant-agent\n"
SYSTEM = (
    "You are a coding agent working in a large repository. Read files before changing them, keep every "
    "change small and tested, explain each step in one short sentence, and never run destructive commands. "
) * 14
TURNS = 10


def h(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("agents")
    keys = work / "keys.txt"
    keys.write_text(KEYS)
    s = ServerProc(["--threads", "2", "--parallel", "2", "--ctx-size", "2048", "--api-keys", str(keys)], work).start()
    yield s
    s.stop()


def slot_ids(srv: ServerProc, key: str) -> set[str]:
    r = httpx.get(srv.url + "/slots", headers=h(key), timeout=60)
    assert r.status_code == 200, r.text
    return {str(s["id"]) for s in r.json()}


def test_smolagents_steps_continue_one_slot(srv: ServerProc) -> None:
    """Each step's prompt keeps the previous step's prompt, then smolagents' rendering of the model's
    answer and the tool's result: the slot that answered the previous step is continued (not a new
    or forked slot per step), and its whole previous prompt is reused."""
    before = slot_ids(srv, "key-agent")
    used: list[str] = []
    usage: list[tuple[int, int]] = []
    for step in range(1, len(STEPS["messages"]) // 2 + 1):
        body = {**STEPS, "messages": STEPS["messages"][: 2 * step], "max_tokens": 12, "temperature": 0}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=h("key-agent"), timeout=600)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["completion_tokens"] > 8, "an answer longer than a re-tokenized end (anonymous.TAIL_SLACK)"
        usage.append((u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]))
        used.append(r.headers["x-slot-id"])
    print("smolagents steps (cached, prompt):", usage)
    assert usage[0][1] > 1000, "the recorded steps are over 1,000 tokens"
    assert len(set(used)) == 1, f"every step on its own slot: {used}"
    for (_, prev_prompt), (cached, prompt) in itertools.pairwise(usage):
        assert prev_prompt <= cached < prompt, usage
    assert slot_ids(srv, "key-agent") - before == {used[0]}, "one anonymous slot for the whole run"


def _turn(srv: ServerProc, who: str, history: list[dict[str, Any]], session: str) -> tuple[str, int, int, str]:
    """One turn of A (Claude Code: Messages API, its session header) or B (OpenCode: Chat
    Completions, its header): (slot id, cached tokens, prompt tokens, the answer's text)."""
    if who == "A":
        body = {"model": "m", "system": SYSTEM, "messages": history, "max_tokens": 4, "temperature": 0}
        headers = h("key-a", **{"X-Claude-Code-Session-Id": session, "anthropic-version": "2023-06-01"})
        r = httpx.post(srv.url + "/v1/messages", json=body, headers=headers, timeout=600)
        assert r.status_code == 200, r.text
        out = r.json()
        u = out["usage"]
        text = "".join(b.get("text", "") for b in out["content"])
        cached = u["cache_read_input_tokens"]
        return r.headers["x-slot-id"], cached, cached + u["input_tokens"], text
    messages = [{"role": "system", "content": SYSTEM}, *history]
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(
        srv.url + "/v1/chat/completions", json=body, headers=h("key-b", **{"x-opencode-session": session}), timeout=600
    )
    assert r.status_code == 200, r.text
    out = r.json()
    u = out["usage"]
    text = out["choices"][0]["message"]["content"] or ""
    return r.headers["x-slot-id"], u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"], text


@pytest.mark.timeout(1800)  # 20 turns; on the loaded 2-core test machine a turn took up to a minute
def test_session_headers_keep_one_slot_per_tenant_for_ten_turns(srv: ServerProc) -> None:
    """Two tenants' agent sessions, interleaved turn by turn, same system prompt, no slot id."""
    history: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    slots: dict[str, set[str]] = {"A": set(), "B": set()}
    figures: dict[str, list[tuple[int, int]]] = {"A": [], "B": []}
    for turn in range(TURNS):
        for who, session in (("A", "cc-session-1"), ("B", "oc-session-1")):
            history[who].append({"role": "user", "content": f"Step {turn + 1}: list the files under src/{who}."})
            slot, cached, prompt, text = _turn(srv, who, history[who], session)
            history[who].append({"role": "assistant", "content": text or "ok"})
            slots[who].add(slot)
            figures[who].append((cached, prompt))
    print("session turns (cached, prompt):", figures)
    assert len(slots["A"]) == len(slots["B"]) == 1, slots
    assert figures["A"][0][1] > 512 and figures["B"][0][1] > 512, "first prompts longer than a batch"
    assert figures["A"][0][0] == 0 and figures["B"][0][0] == 0, "neither tenant reuses the other's system prompt"
    for who in ("A", "B"):
        for cached, prompt in figures[who][1:]:
            assert cached >= 0.95 * prompt, (who, figures[who])
    assert slots["A"] <= slot_ids(srv, "key-a") and not slots["A"] & slot_ids(srv, "key-b")
    assert slots["B"] <= slot_ids(srv, "key-b") and not slots["B"] & slot_ids(srv, "key-a")
