"""KoboldCpp's API as KoboldAI Lite and SillyTavern use it: their exact request bodies, replayed.

The bodies are built as the clients build them:

* KoboldAI Lite (``klite.embd`` in LostRuins/koboldcpp): ``submit_payload.params`` with the
  prompt put inside, ``memory`` + ``trim_stop``, ``genkey`` ("KCPP" + 4 digits) when it
  streams, the mirostat-era extras (``min_p``, ``dynatemp_*``, ``smoothing_factor``,
  ``banned_tokens`` as strings, ``render_special``), ``presence_penalty``, ``logit_bias``,
  ``quiet``, ``stop_sequence``, ``use_default_badwordsids``, ``bypass_eos``;
* SillyTavern (``public/scripts/kai-settings.js``, ``getKoboldGenerationData``) with every
  KoboldCpp flag on.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProc
from tests.orchestrator.client import sse_events
from tests.waiting import wait_until

STORY = "The knight rode to the castle. "


def lite_body(prompt: str, genkey: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "n": 1, "max_context_length": 2048, "max_length": 40, "rep_pen": 1.07, "temperature": 0.7,
        "top_p": 0.92, "top_k": 100, "top_a": 0, "typical": 1, "tfs": 1, "rep_pen_range": 360,
        "rep_pen_slope": 0.7, "sampler_order": [6, 0, 1, 3, 4, 2, 5], "memory": "[Genre: fantasy]\n",
        "trim_stop": True, "genkey": genkey, "min_p": 0, "dynatemp_range": 0, "dynatemp_exponent": 1,
        "smoothing_factor": 0, "banned_tokens": [], "render_special": False, "presence_penalty": 0,
        "logit_bias": {}, "prompt": prompt, "quiet": True, "stop_sequence": ["\nYou:", "\nYou "],
        "use_default_badwordsids": False, "bypass_eos": False,
    }  # fmt: skip
    return {**body, **over}


def sillytavern_body(prompt: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt, "gui_settings": False, "sampler_order": [6, 0, 1, 3, 4, 2, 5],
        "max_context_length": 2048, "max_length": 24, "rep_pen": 1.1, "rep_pen_range": 0,
        "rep_pen_slope": 1, "temperature": 0, "tfs": 1, "top_a": 0, "top_k": 0, "top_p": 1, "min_p": 0,
        "typical": 1, "use_world_info": False, "singleline": False, "stop_sequence": ["\nUser:"],
        "streaming": False, "can_abort": True, "mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1,
        "use_default_badwordsids": False, "grammar": "", "api_server": "http://127.0.0.1:5001/api",
    }  # fmt: skip
    return {**body, **over}


def test_version_and_config_polls(server: ServerProc) -> None:
    get = lambda p: httpx.get(server.url + p, timeout=30).json()  # noqa: E731
    v = get("/api/extra/version")
    assert v["result"] == "KoboldCpp" and tuple(int(x) for x in v["version"].split(".")[:2]) >= (1, 48)
    assert get("/api/v1/info/version") == {"result": "1.2.5"}
    assert get("/api/v1/config/max_context_length") == {"value": 2048}
    assert get("/api/extra/true_max_context_length") == {"value": 2048}
    assert get("/api/v1/config/max_length")["value"] > 0


def test_tokencount(server: ServerProc) -> None:
    r = httpx.post(server.url + "/api/extra/tokencount", json={"prompt": "Hello world, hello!"}, timeout=30).json()
    ref = httpx.post(server.url + "/tokenize", json={"content": "Hello world, hello!", "add_special": True}).json()
    assert r["value"] == len(r["ids"]) == len(ref["tokens"]) and r["ids"] == ref["tokens"]
    bad = httpx.post(server.url + "/api/extra/tokencount", content=b"{nope", timeout=30)
    assert bad.status_code == 400 and bad.json()["error_code"] == "INVALID_REQUEST"


def test_lite_stream_trims_stop_and_memory_counts(server: ServerProc) -> None:
    body = lite_body("Count: 1, 2, 3, 4,", "KCPP1001", temperature=0, stop_sequence=[" 7"], memory="",
                     id_slot="kb-lite")  # fmt: skip
    events = sse_events(server.url, body)
    text = "".join(e["token"] for e in events)
    assert events[-1]["finish_reason"] == "stop" and " 7" not in text and text.startswith(" 5, 6,")
    untrimmed = sse_events(server.url, {**body, "trim_stop": False})
    assert "".join(e["token"] for e in untrimmed).endswith(" 7")


def test_lite_polled_generation_check_and_abort(server: ServerProc) -> None:
    # bypass_eos: the generation is still running when the abort comes (an early end-of-text would win the race)
    body = lite_body(STORY * 5, "KCPP2002", max_length=400, stop_sequence=[], id_slot="kb-poll", bypass_eos=True)
    result: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: result.append(httpx.post(server.url + "/api/v1/generate", json=body, timeout=120))
    )
    t.start()

    def partial() -> str:
        check = httpx.post(server.url + "/api/extra/generate/check", json={"genkey": "KCPP2002"})
        text: str = check.json()["results"][0]["text"]
        return text if len(text) > 5 else ""

    text = wait_until(partial, "generate/check shows partial text")
    assert httpx.post(server.url + "/api/extra/generate/check", json={"genkey": "KCPP-other"}).json() == {
        "results": [{"text": ""}]
    }
    ab = httpx.post(server.url + "/api/extra/abort", json={"genkey": "KCPP2002"}).json()
    assert ab == {"success": "true", "done": "true"}
    t.join()
    out = result[0].json()
    assert out["results"][0]["finish_reason"] == "abort" and out["results"][0]["text"].startswith(text)
    assert httpx.post(server.url + "/api/extra/abort", json={"genkey": "KCPP2002"}).json()["success"] == "false"
    perf = httpx.get(server.url + "/api/extra/perf").json()
    assert (
        perf["total_gens"] >= 1 and perf["last_token_count"] > 0 and perf["stop_reason"] == 0
    )  # KoboldCpp: an abort keeps OUT_OF_TOKENS
    assert perf["idle"] in (0, 1) and perf["uptime"] > 0


def test_string_banned_tokens(server: ServerProc) -> None:
    body = lite_body("Count: 1, 2, 3, 4,", "KCPP3003", temperature=0, memory="", stop_sequence=[], max_length=12,
                     id_slot="kb-ban")  # fmt: skip
    free = httpx.post(server.url + "/api/v1/generate", json=body, timeout=120).json()["results"][0]["text"]
    assert "," in free
    banned = httpx.post(server.url + "/api/v1/generate", json={**body, "banned_tokens": [","]}, timeout=120).json()
    assert "," not in banned["results"][0]["text"]


def test_context_over_the_window(server: ServerProc) -> None:
    long_prompt = "one two three four five six seven eight nine ten " * 30  # ~300 tokens
    body = sillytavern_body(long_prompt, max_context_length=128, max_length=8, id_slot="kb-trim")
    r = httpx.post(server.url + "/api/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_tokens"] == 128 - 8  # the front was trimmed, the end of the story kept
    huge = {"prompt": "word " * 2100, "max_length": 8, "id_slot": "kb-trim"}  # no max_context_length: no trimming
    r = httpx.post(server.url + "/api/v1/generate", json=huge, timeout=120)
    assert r.status_code == 400 and r.json()["error_code"] == "CONTEXT_OVERFLOW"
    no_room = httpx.post(server.url + "/api/v1/generate", json={**body, "max_context_length": 8}, timeout=120)
    assert no_room.status_code == 400 and no_room.json()["error_code"] == "CONTEXT_OVERFLOW"


def test_sillytavern_body_and_unsupported_fields_warned(server: ServerProc) -> None:
    body = sillytavern_body("User: Hi!\nAssistant:", id_slot="kb-st", mirostat=2, grammar='root ::= "a"', top_a=0.5)
    r = httpx.post(server.url + "/api/v1/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["results"][0]["text"] == "a"  # grammar and Mirostat are honoured
    warning = [line for line in server.log().splitlines() if "Kobold fields not supported" in line][-1]
    assert "top_a" in warning and "mirostat" not in warning and "grammar" not in warning
    streamed = sse_events(server.url, {**body, "streaming": True})
    assert streamed[-1]["finish_reason"] in ("stop", "length")


def test_requests_without_a_slot_id_at_once(server: ServerProc) -> None:
    body = sillytavern_body("User: Tell me a story.\nAssistant:", max_length=30)  # no slot id: one each
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(
        httpx.post(server.url + "/api/v1/generate", json=body, timeout=600))) for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200], [r.text[:200] for r in results]


def slot_zero_busy(srv: ServerProc) -> bool:
    return any(s["id"] == 0 and s["is_processing"] for s in httpx.get(srv.url + "/slots").json())


@pytest.mark.slow
def test_queue_wait_is_bounded(start_server) -> None:  # type: ignore[no-untyped-def]
    # requests naming no slot share slot "0" (matching off), so the second waits for the first
    srv = start_server("--slot-wait", "1", "--ctx-size", "1024", "--no-persist", "--slot-prompt-similarity", "0")
    long = {"prompt": STORY, "max_length": 500, "ignore_eos": True}
    t = threading.Thread(target=lambda: httpx.post(srv.url + "/api/v1/generate", json=long, timeout=120))
    t.start()
    wait_until(lambda: slot_zero_busy(srv), "the long generation runs")
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/api/v1/generate", json={"prompt": STORY, "max_length": 2}, timeout=120)
    waited = time.monotonic() - t0
    httpx.post(srv.url + "/api/extra/abort", json={})
    t.join()
    assert r.status_code == 409 and r.json()["error_code"] == "SLOT_BUSY" and "1 s" in r.json()["error"]
    assert 0.9 < waited < 30


def test_ban_eos_and_bypass_eos(server: ServerProc) -> None:
    bare = {"prompt": "What is the capital of France?", "max_length": 6, "temperature": 0, "id_slot": "kb-eos"}
    first = httpx.post(server.url + "/api/v1/generate", json=bare, timeout=120).json()
    assert first["finish_reason"] == "stop_token"  # this instruct model ends the turn at once
    banned = httpx.post(server.url + "/api/v1/generate", json={**bare, "use_default_badwordsids": True}, timeout=120)
    out = banned.json()
    assert out["finish_reason"] == "length" and out["total_tokens"] == 6
    eog = set(httpx.get(server.url + "/api/v1/model").json()["eog_token_ids"])
    assert not eog & {t["token_id"] for t in out["generated_tokens"]}
    bypass = httpx.post(server.url + "/api/v1/generate", json={**bare, "bypass_eos": True}, timeout=120).json()
    assert bypass["finish_reason"] == "length" and bypass["total_tokens"] == 6


def test_unset_fields_get_koboldcpps_defaults(server: ServerProc) -> None:
    """A Kobold body that leaves fields out gets KoboldCpp's defaults (koboldcpp.py ``generate``,
    1.82.4), not llama-server's; the other routes keep llama-server's."""
    assert httpx.get(server.url + "/api/v1/config/max_length", timeout=30).json() == {"value": 200}
    r = httpx.post(server.url + "/api/v1/generate",
                   json={"prompt": STORY, "bypass_eos": True, "genkey": "KCPP0200", "id_slot": "kdef"},
                   timeout=600)  # fmt: skip
    assert r.status_code == 200, r.text
    assert len(r.json()["generated_tokens"]) == 200  # max_length 200, no EOS stop
    slot = {str(s["id"]): s for s in httpx.get(server.url + "/slots", timeout=30).json()}["kdef"]
    p = slot["params"]
    assert (p["temperature"], p["top_k"], p["top_p"], p["min_p"]) == (0.75, 100, 0.92, 0.0)
    assert (p["repeat_penalty"], p["repeat_last_n"], p["typical_p"]) == (1.0, 320, 1.0)
    assert (p["xtc_threshold"], p["dry_base"], p["dry_allowed_length"], p["dry_penalty_last_n"]) == (0.2, 1.75, 2, 320)
    assert (p["mirostat_tau"], p["mirostat_eta"], p["dry_sequence_breakers"]) == (5.0, 0.1, [])
    # The SSE stream is KoboldCpp's route too; llama-server's /completion keeps its own defaults.
    with httpx.stream("POST", server.url + "/api/extra/generate/stream",
                      json={"prompt": STORY, "max_length": 2, "id_slot": "kdef"}, timeout=120) as s:  # fmt: skip
        assert s.status_code == 200
        s.read()
    slot = {str(s["id"]): s for s in httpx.get(server.url + "/slots", timeout=30).json()}["kdef"]
    assert (slot["params"]["temperature"], slot["params"]["top_k"]) == (0.75, 100)
    r = httpx.post(server.url + "/completion", json={"prompt": STORY, "n_predict": 2, "id_slot": 9}, timeout=120)
    assert r.status_code == 200, r.text
    assert (r.json()["generation_settings"]["temperature"], r.json()["generation_settings"]["top_k"]) == (0.8, 40)


def _pruning_context(server: ServerProc, tag: str) -> tuple[list[int], list[int]]:
    """A ~350-token context and the same with 60 tokens cut from its middle (as Halo Weave prunes)."""
    text = "".join(f"{tag} note {i}: the {('red', 'blue', 'green', 'amber')[i % 4]} kite {i * 7} flew over "
                   f"{i * 13} hills near lake {i * 3 + 1}. " for i in range(20))  # fmt: skip
    ids = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": True}, timeout=30).json()["tokens"]
    assert len(ids) > 300
    return ids, ids[:100] + ids[160:]


def test_kobold_routes_reuse_a_pruned_cache_by_default(server: ServerProc) -> None:
    """KoboldCpp's ContextShift default: a Kobold request that leaves ``n_cache_reuse`` out reuses the KV of
    the runs after a pruned middle (counted as cached); llama-server's ``/completion`` without it keeps only
    the common prefix (llama-server's default), and a Kobold request with ``n_cache_reuse`` 0 re-prefills."""
    ids, pruned = _pruning_context(server, "Kobold")
    body = {"max_length": 1, "temperature": 0, "id_slot": "kb-reuse"}
    assert httpx.post(server.url + "/api/v1/generate", json={**body, "input_ids": ids}, timeout=300).status_code == 200
    again = httpx.post(server.url + "/api/v1/generate", json={**body, "input_ids": pruned}, timeout=300).json()
    assert again["prompt_tokens"] == len(pruned) and again["cached_tokens"] >= len(pruned) - 8  # reused, not 100
    twice = pruned[:150] + pruned[190:]  # pruned again, through the SSE route
    streamed = sse_events(server.url, {**body, "input_ids": twice, "output_attentions": True})
    assert streamed[-1]["type"] == "done" and streamed[-1]["cached_tokens"] >= len(twice) - 8
    exact = httpx.post(server.url + "/api/v1/generate", json={**body, "input_ids": pruned, "n_cache_reuse": 0},
                       timeout=300).json()  # fmt: skip
    assert exact["cached_tokens"] == 150  # asked for: the exact re-prefill after the common prefix

    ids, pruned = _pruning_context(server, "Llama")
    base = {"n_predict": 1, "temperature": 0, "id_slot": "ls-reuse"}
    assert httpx.post(server.url + "/completion", json={**base, "prompt": ids}, timeout=300).status_code == 200
    timings = httpx.post(server.url + "/completion", json={**base, "prompt": pruned}, timeout=300).json()["timings"]
    assert timings["cache_n"] == 100 and timings["prompt_n"] == len(pruned) - 100  # off: llama-server's default
