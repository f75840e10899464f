"""Reasoning output as llama-server gives it: a thinking template's thoughts split into ``reasoning_content``
(``reasoning_format``), a thinking budget that forces the end of a thought, through the OpenAI SDK (chat and
Responses), the Anthropic SDK and llama-server's ``/completion``.

The server tests run the default GGUF with Qwen3's chat template written into a copy (as the Hermes
tests of test_tool_calls_hermes.py do).  SmolLM2 never opens a ``<think>`` by itself, so the conversations end
with an assistant prefill ``<think>\n`` (llama-server's ``continue_final_message``): the prompt opens the
thought and the model's first tokens are its reasoning, as with a template whose generation prompt opens it.
"""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.generation.answer_text import AnswerText
from orchestrator.generation.parsers.reasoning import (
    ReasoningParser,
    ThinkingTags,
    opened_by,
    reasoning_format_of,
    reasoning_plan,
    thinking_tags,
)
from orchestrator.generation.pieces import CallDelta, ReasoningDelta
from orchestrator.generation.tool_plan import plan_of
from orchestrator.service_error import ServiceError
from tests.conftest import ServerProc, with_chat_template

# Qwen3's chat template (Qwen/Qwen3-0.6B tokenizer_config.json, as llama.cpp keeps it in models/templates/)
QWEN3 = "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {%- set content = message.content %}\n        {%- set reasoning_content = '' %}\n        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}\n            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n            {%- if '</think>' in message.content %}\n                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n            {%- if loop.last or (not loop.last and reasoning_content) %}\n                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n                {%- endif %}\n                {%- if tool_call.function %}\n                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n                    {{- tool_call.arguments }}\n                {%- else %}\n                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
THINK = ThinkingTags("<think>", "</think>")
MESSAGE = " Time to answer."
ASK = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "<think>\n"}]


# ----------------------------------------------------------------------------- parsing (no server)


def test_thinking_tags_come_from_the_template() -> None:
    assert thinking_tags(QWEN3) == THINK
    assert thinking_tags("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    assert thinking_tags("[THINK]{{ x }}[/THINK]") == ThinkingTags("[THINK]", "[/THINK]")
    assert opened_by("<|im_start|>assistant\n<think>\n", THINK) and not opened_by("<think>\n\n</think>\n\n", THINK)
    plan = reasoning_plan(QWEN3, "<|im_start|>assistant\n", "none", 5, "m")
    assert plan is not None and plan.parser() is None and not plan.opened  # none: a budget still, no split
    assert reasoning_plan("{{ messages }}", "", "auto", -1, "") is None
    for bad in ("deepseek-legacy", "", "DEEPSEEK"):
        with pytest.raises(ServiceError, match="Unknown reasoning format"):
            reasoning_format_of(bad, "auto")
    assert reasoning_format_of(None, "none") == "none"


WHOLE = [
    # (answer, opened, reasoning, content)
    ("<think>\nTwo and two.\n</think>\n\nFour.", False, "Two and two.", "Four."),
    ("  <think>a <b> c</think>d ", False, "a <b> c", "d "),
    ("No thought here.", False, "", "No thought here."),
    ("\n\nHello", False, "", "\n\nHello"),
    ("<think>cut sh", False, "cut sh", ""),  # max_tokens ended the thought
    ("<thi", False, "", "<thi"),  # not a thought after all
    ("Then <think>late</think>", False, "", "Then <think>late</think>"),  # only at the start
    ("I wonder. Time to answer.</think>\n\nIt is 4.", True, "I wonder. Time to answer.", "It is 4."),
    ("</think>x", True, "", "x"),
    ("\u00e9t\u00e9 </think", True, "\u00e9t\u00e9 </think", ""),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), WHOLE)
def test_reasoning_split_at_every_boundary_matches_the_whole(
    text: str, opened: bool, reasoning: str, content: str
) -> None:
    """The whole answer's split, and the same answer streamed in two pieces at every character and one
    character at a time: the same reasoning and content, no tag in either."""
    whole = ReasoningParser(THINK, opened).whole(text)
    assert "".join(p.text for p in whole if isinstance(p, ReasoningDelta)) == reasoning
    assert "".join(p for p in whole if isinstance(p, str)) == content
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser = ReasoningParser(THINK, opened)
        out = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
        assert "".join(p.text for p in out if isinstance(p, ReasoningDelta)) == reasoning, pieces
        assert "".join(p for p in out if isinstance(p, str)) == content, pieces


def test_reasoning_streams_as_it_comes() -> None:
    parser = ReasoningParser(THINK)
    sent = [parser.feed(p) for p in ["<th", "ink>\n", "One", " two ", "</th", "ink>", "\n\n", "Four"]]
    assert sent == [[], [], [ReasoningDelta("One")], [ReasoningDelta(" two")], [], [], [], ["Four"]]
    assert parser.finish() == []


def test_thoughts_then_a_tool_call() -> None:
    """A Qwen3 answer that thinks, then calls a tool: the thought is reasoning, the call a call (the Hermes
    parser never sees the thought), streamed and whole alike."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = plan_of(QWEN3, tools, "auto", False)
    assert plan is not None and plan.format == "hermes"
    text = (
        '<think>\nUse <tool_call> here.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    whole = AnswerText([], plan.splitter(), ReasoningParser(THINK)).whole([text])
    assert whole.reasoning == "Use <tool_call> here." and whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("add", {"a": 1})]
    streamed = AnswerText([], plan.splitter(), ReasoningParser(THINK))
    out = [p for ch in text for p in streamed.feed(ch)] + streamed.finish()
    assert "".join(p.text for p in out if isinstance(p, ReasoningDelta)) == whole.reasoning
    assert "".join(p.arguments for p in out if isinstance(p, CallDelta)) == whole.calls[0].arguments


# ----------------------------------------------------------------------------- a thinking template, served


@pytest.fixture(scope="module")
def qwen3_gguf(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default GGUF with Qwen3's chat template as its ``tokenizer.chat_template``."""
    return with_chat_template(model_path, QWEN3, tmp_path_factory.mktemp("qwen3") / "smollm2-qwen3.gguf")


@pytest.fixture(scope="module")
def thinker(qwen3_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server on the Qwen3-templated GGUF with llama-server's budget message."""
    work = tmp_path_factory.mktemp("thinker")
    srv = ServerProc(
        ["--model", str(qwen3_gguf), "--parallel", "4", "--ctx-size", "1024", "--threads", "2",
         "--state-dir", str(work / "st"), "--reasoning-budget-message", MESSAGE],
        work,
    ).start()  # fmt: skip
    yield srv
    srv.stop()


BUDGET = 6
THINKING = {"thinking_budget_tokens": BUDGET, "ignore_eos": True}  # ignore_eos: an answer after the thought


def test_openai_sdk_thinking_in_its_field_and_a_budget_that_cuts_it(thinker: ServerProc) -> None:
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    kw: dict[str, Any] = dict(model="m", messages=ASK, max_tokens=24, temperature=0)
    r = c.chat.completions.create(**kw, user="rs-1", extra_body=THINKING)
    msg = r.choices[0].message
    thought = (msg.model_extra or {})["reasoning_content"]
    assert thought.endswith(MESSAGE.strip()) and "<think>" not in thought and "</think>" not in thought
    assert msg.content and "</think>" not in msg.content and MESSAGE.strip() not in msg.content
    assert r.usage.completion_tokens == 24  # the thought, the forced message and end tag, the answer
    # streamed: reasoning_content deltas, then content deltas, concatenating to the whole answer's; every
    # generated token (the thought's and the forced ones too) has its attention row on some chunk
    chunks = list(
        c.chat.completions.create(
            **kw, user="rs-2", stream=True, stream_options={"include_usage": True},
            extra_body={**THINKING, "attention": {"format": "aggregated"}},
        )
    )  # fmt: skip
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    thoughts = [(d.model_extra or {}).get("reasoning_content") or "" for d in deltas]
    assert sum(1 for t in thoughts if t) > 1 and "".join(thoughts) == thought
    assert "".join(d.content or "" for d in deltas) == msg.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not t for t in thoughts[first_content:])  # the thought comes first, whole
    rows = [a for ch in chunks if ch.choices for a in (ch.choices[0].model_extra or {}).get("attention") or []]
    n_prompt = chunks[-1].usage.prompt_tokens
    assert len(rows) == chunks[-1].usage.completion_tokens == 24
    assert [a["shape"] for a in rows] == [[n_prompt + k] for k in range(24)]
    assert all(len(base64.b64decode(a["data"])) == 4 * (n_prompt + k) for k, a in enumerate(rows))
    # reasoning_format none: the thought stays in content, tags and message included
    raw = c.chat.completions.create(**kw, user="rs-3", extra_body={**THINKING, "reasoning_format": "none"})
    assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    before, after = (raw.choices[0].message.content or "").split("</think>", 1)
    assert before.strip() == thought and after.lstrip() == msg.content
    # no budget: the thought runs to max_tokens, all of it reasoning
    free = c.chat.completions.create(**kw, user="rs-4", extra_body={"ignore_eos": True})
    assert (free.choices[0].message.model_extra or {})["reasoning_content"] and not free.choices[0].message.content
    assert MESSAGE.strip() not in (free.choices[0].message.model_extra or {})["reasoning_content"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"reasoning_format": "bogus"}, "Unknown reasoning format"),
        ({"thinking_budget_tokens": -2}, "thinking_budget_tokens"),
        ({"reasoning_budget_tokens": "many"}, "reasoning_budget_tokens"),
    ],
)
def test_bad_reasoning_requests_are_400(thinker: ServerProc, body: dict[str, Any], needle: str) -> None:
    r = httpx.post(thinker.url + "/v1/chat/completions", json={"messages": ASK, "user": "rs-bad", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST" and needle in r.text, r.text
    assert httpx.get(thinker.url + "/api/v1/slots/rs-bad", timeout=30).status_code == 404  # nothing made


def test_responses_api_reasoning_item(thinker: ServerProc) -> None:
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    kw: dict[str, Any] = dict(model="m", input=ASK, max_output_tokens=20, temperature=0, store=False)
    whole = c.responses.create(**kw, extra_body=THINKING)
    kinds = [item.type for item in whole.output]
    assert kinds[:2] == ["reasoning", "message"], kinds
    thought = whole.output[0].content[0].text
    assert thought.endswith(MESSAGE.strip()) and "</think>" not in whole.output_text  # (no ignore_eos here)
    events = list(c.responses.create(**kw, stream=True, extra_body=THINKING))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == thought
    assert types.index("response.reasoning_text.done") < types.index("response.content_part.added")
    final = events[-1].response
    assert [i.type for i in final.output] == kinds and final.output[0].content[0].text == thought


def test_anthropic_sdk_thinking_block_and_budget(thinker: ServerProc) -> None:
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0, timeout=600)
    kw: dict[str, Any] = dict(
        model="m", max_tokens=20, messages=ASK, thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={"temperature": 0},
    )  # fmt: skip
    m = c.messages.create(**kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking.endswith(MESSAGE.strip())
    assert m.content[0].signature == "" and all(b.type != "thinking" for b in m.content[1:])
    with c.messages.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == m.content[0].thinking
    assert [b.type for b in final.content] == [b.type for b in m.content]
    assert "thinking" in kinds and "signature" in kinds  # thinking_delta and signature_delta, as the SDK names them
    bad = httpx.post(
        thinker.url + "/v1/messages",
        json={"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": -3}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error_code"] == "INVALID_REQUEST", bad.text
    free = c.messages.create(**{**kw, "thinking": {"type": "disabled"}, "max_tokens": 8})
    assert free.content[0].type == "thinking" and MESSAGE.strip() not in free.content[0].thinking


def test_llama_server_completion_budget_and_split(thinker: ServerProc) -> None:
    """``/completion`` on the template's prompt: the budget (llama-server's fields) cuts the thought in the
    raw text; ``reasoning_format`` puts it in ``reasoning_content``, streamed and not."""
    prompt = httpx.post(thinker.url + "/apply-template", json={"messages": ASK}, timeout=60).json()["prompt"]
    assert prompt.endswith("<think>\n")
    body = {"prompt": prompt, "n_predict": 20, "temperature": 0, "ignore_eos": True, "reasoning_budget_tokens": BUDGET}
    raw = httpx.post(thinker.url + "/completion", json=body, timeout=300).json()
    assert f"{MESSAGE.strip()}</think>" in raw["content"] and "reasoning_content" not in raw
    split = httpx.post(thinker.url + "/completion", json={**body, "reasoning_format": "auto"}, timeout=300).json()
    thought, answer = raw["content"].split("</think>", 1)
    assert split["reasoning_content"] == thought.strip() and split["content"] == answer.lstrip()
    with httpx.stream("POST", thinker.url + "/completion", json={**body, "reasoning_format": "auto", "stream": True},
                      timeout=300) as r:  # fmt: skip
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e.get("reasoning_content", "") for e in events) == split["reasoning_content"]
    assert "".join(e["content"] for e in events) == split["content"]
    bad = httpx.post(thinker.url + "/completion", json={**body, "reasoning_format": "nope"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error_code"] == "INVALID_REQUEST"


def test_budgets_cut_at_their_token_for_several_users_at_once(thinker: ServerProc) -> None:
    """Three ``/completion`` requests at once, each on its own slot with its own budget, one with a prompt
    longer than a batch (512 tokens): in each, the generated tokens after exactly ``budget`` tokens of
    thought are the forced message and end tag (the budget is per sequence, counted in tokens)."""

    def ids(text: str) -> list[int]:
        r = httpx.post(thinker.url + "/tokenize", json={"content": text, "add_special": False}, timeout=60)
        return [int(t) for t in r.json()["tokens"]]

    forced = ids(MESSAGE) + ids("</think>")
    short = httpx.post(thinker.url + "/apply-template", json={"messages": ASK}, timeout=60).json()["prompt"]
    ask = [{"role": "user", "content": "Count: " + " ".join(str(i) for i in range(170))}, ASK[1]]
    long = httpx.post(thinker.url + "/apply-template", json={"messages": ask}, timeout=60).json()["prompt"]
    assert len(ids(long)) > 512

    def run(budget: int, prompt: str, slot: str) -> tuple[int, list[int]]:
        body = {"prompt": prompt, "n_predict": budget + len(forced) + 3, "temperature": 0, "ignore_eos": True,
                "reasoning_budget_tokens": budget, "return_tokens": True, "id_slot": slot}  # fmt: skip
        r = httpx.post(thinker.url + "/completion", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return budget, r.json()["tokens"]

    with ThreadPoolExecutor(3) as pool:
        done = list(pool.map(run, [2, 5, 9], [short, long, short], ["rs-c1", "rs-c2", "rs-c3"]))
    for budget, tokens in done:
        assert tokens[budget : budget + len(forced)] == forced, (budget, tokens)


def test_ollama_think_splits_the_thinking(thinker: ServerProc) -> None:
    """Ollama's ``think`` through the ``ollama`` client: true splits the thought into ``message.thinking``
    (streamed and whole alike, the same thought llama-server's split gives), unset leaves it in the content
    (as Ollama without ``think``), false renders the template with ``enable_thinking`` false (Qwen3's template
    then writes an empty thought into the prompt)."""
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=thinker.url, timeout=600)
    m = c.list().models[0].model or ""
    opts = {"temperature": 0, "num_predict": 12}
    whole = c.chat(model=m, messages=ASK, think=True, options=opts, stream=False)
    thought = whole.message.thinking or ""
    assert thought and not whole.message.content and "<think>" not in thought
    r = httpx.post(thinker.url + "/v1/chat/completions", timeout=600,
                   json={"messages": ASK, "max_tokens": 12, "temperature": 0, "user": "ol-ref"})  # fmt: skip
    assert r.json()["choices"][0]["message"]["reasoning_content"] == thought
    chunks = list(c.chat(model=m, messages=ASK, think=True, options=opts, stream=True))
    assert sum(1 for ch in chunks if ch.message.thinking) > 1
    assert "".join(ch.message.thinking or "" for ch in chunks) == thought
    assert not "".join(ch.message.content or "" for ch in chunks) and chunks[-1].done
    plain = c.chat(model=m, messages=ASK, options=opts, stream=False)
    assert not plain.message.thinking and (plain.message.content or "").strip() == thought.strip()
    ask = ASK[:1]
    unset = c.chat(model=m, messages=ask, options={**opts, "num_predict": 1}, stream=False)
    off = c.chat(model=m, messages=ask, think=False, options={**opts, "num_predict": 1}, stream=False)
    empty_thought = len(httpx.post(thinker.url + "/tokenize", json={"content": "<think>\n\n</think>\n\n"},
                                   timeout=60).json()["tokens"])  # fmt: skip
    assert off.prompt_eval_count == unset.prompt_eval_count + empty_thought
    gen = c.generate(model=m, prompt="What is two plus two?", think=True, options=opts, stream=False)
    assert gen.response and not gen.thinking  # the generation prompt opens no thought and none was written


def test_chat_template_kwargs_reach_the_template(thinker: ServerProc) -> None:
    """llama-server's ``chat_template_kwargs``: ``enable_thinking`` false makes Qwen3's template write an empty
    thought into the prompt, on ``/apply-template``, ``input_tokens`` and the chat itself alike; a name the
    server sets itself (``messages``) is not replaced; a body whose kwargs are not an object is 400."""
    ask = {"messages": ASK[:1]}
    off = {**ask, "chat_template_kwargs": {"enable_thinking": False, "messages": []}}
    plain = httpx.post(thinker.url + "/apply-template", json=ask, timeout=60).json()["prompt"]
    thoughtless = httpx.post(thinker.url + "/apply-template", json=off, timeout=60).json()["prompt"]
    assert thoughtless == plain + "<think>\n\n</think>\n\n" and "What is two plus two?" in thoughtless
    n = [httpx.post(thinker.url + "/v1/chat/completions/input_tokens", json=b, timeout=60).json()["input_tokens"]
         for b in (ask, off)]  # fmt: skip
    r = httpx.post(thinker.url + "/v1/chat/completions", timeout=600,
                   json={**off, "max_tokens": 1, "user": "ctk-1"}).json()  # fmt: skip
    assert r["usage"]["prompt_tokens"] == n[1] > n[0]
    bad = httpx.post(thinker.url + "/v1/chat/completions", json={**ask, "chat_template_kwargs": [1]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error_code"] == "INVALID_REQUEST", bad.text
