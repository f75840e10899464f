"""Ollama's requests as slotserve's generation requests, and its answers shaped from what a generation yields.

Ollama's ``docs/api.md`` and ``api/types.go`` (ollama/ollama) are the contract; the wire types are
:mod:`orchestrator.api.ollama.protocol`.  What is particular to this server (docs/api.md, "Ollama API"):

* one model is served, under its name (``--alias`` names too), with or without the ``:latest`` tag;
  another name is Ollama's 404 ``model '<name>' not found``;
* ``/api/chat`` renders ``messages`` with the model's own chat template as every chat surface does
  (:mod:`orchestrator.api.common.chat`: a last assistant message is continued), ``tools`` through
  :mod:`orchestrator.generation.tool_calls` (``tool_choice`` ``auto``: Ollama has no other);
  ``/api/generate`` renders ``system`` and ``prompt`` as one user turn (``raw``: the prompt as it is);
* ``context`` of ``/api/generate`` is token ids: the answer's ``context`` is the request's prompt tokens
  and the generated ones, and a request that sends it back continues exactly those tokens, so the
  conversation's slot reuses its whole KV cache (llama-server's prefix reuse);
* ``format``: ``"json"`` constrains the answer to a JSON object, a JSON schema to that schema (llama.cpp's
  grammar from the schema, as ``json_schema`` on the other APIs);
* ``keep_alive``: ``0`` parks the conversation's slot (its KV state saved to the store, its engine
  sequence freed) as soon as the answer is done; another duration parks it once idle that long
  (negative: never for being idle); without it, ``--park-idle`` and the least-recently-used rule apply;
* the slot: the ``X-Slot-Id`` header if given, else the server's choice, keyed by the session headers
  (``X-Session-Id``, ``session_id``) when present; the caller's tenant (:func:`principal_of`) scopes it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from typing import Any

from litestar import Request

from contract.errors import ErrorCode
from contract.model_facts import ModelInfo
from orchestrator.api.common.chat import chat_ids, chat_prompt_ids, reasoning_of
from orchestrator.api.common.chat import chat_prompt as render_chat
from orchestrator.api.common.run import AfterTurn, remaining
from orchestrator.api.ollama.protocol import (
    ChatResponse,
    DoneReason,
    Format,
    GenerateResponse,
    KeepAlive,
    Message,
    ModelDetails,
    Options,
    Think,
    Tool,
    ToolCall,
    ToolCallFunction,
)
from orchestrator.generation.events import DoneOut
from orchestrator.generation.parsers.reasoning import ReasoningParser
from orchestrator.generation.request import DEFAULT, CanonicalRequest
from orchestrator.generation.tool_calls import ToolCall as ParsedCall
from orchestrator.generation.tool_plan import ToolPlan
from orchestrator.services import Services
from orchestrator.slots.model import Slot
from orchestrator.tenants.principal import principal_of
from orchestrator.web.errors import ApiError

OLLAMA_VERSION = "0.9.0"
"""What ``/api/version`` answers: an Ollama release whose API has everything served here (tools,
structured outputs, ``think``), so apps that check for a minimum version find it."""

SESSION_HEADERS = ("x-session-id", "session_id")
"""Request headers naming a conversation (its key for the slot pick, ``CanonicalRequest.conversation_key``)."""

NEVER = "9999-12-31T23:59:59Z"
"""``/api/ps``'s ``expires_at`` of the served model: it is never unloaded."""

_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def now() -> str:
    """The current time as Ollama's ``created_at`` (RFC 3339, UTC)."""
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def now_ns() -> int:
    """A monotonic clock in nanoseconds (for the durations the server measures itself)."""
    return time.monotonic_ns()


def ns(ms: float) -> int:
    """Milliseconds as Ollama's nanosecond durations."""
    return int(ms * 1_000_000)


def keep_alive_s(value: KeepAlive | None) -> float | None:
    """``keep_alive`` in seconds (None: not given; ``inf``: negative, keep forever), parsed as Ollama's
    ``api.Duration``: a JSON number of seconds or a Go duration string (``time.ParseDuration``:
    ``"5m"``, ``"1h30m"``, ``"0"``).  A malformed string is ``INVALID_REQUEST``."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return float("inf") if value < 0 else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _GO_DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _GO_UNIT_S[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ApiError(ErrorCode.INVALID_REQUEST, f"keep_alive: time: invalid duration {value!r}")
    return float("inf") if sign < 0 else total


def check_model(services: Services, name: str) -> str:
    """``name`` if it names the served model (its id or an ``--alias``, ``:latest`` optional); empty:
    ``INVALID_REQUEST`` (Ollama's "model is required"); another: ``NOT_FOUND`` (404, Ollama's message)."""
    if not name:
        raise ApiError(ErrorCode.INVALID_REQUEST, "model is required")
    known = {services.model_id, *services.settings.alias}
    if name not in known and name.removesuffix(":latest") not in known:
        raise ApiError(ErrorCode.NOT_FOUND, f"model '{name}' not found")
    return name


def model_names(services: Services) -> list[str]:
    """The served model's names as Ollama lists them (``name:tag``, ``latest`` when untagged)."""
    names = [services.model_id, *sorted(set(services.settings.alias) - {services.model_id})]
    return [n if ":" in n else f"{n}:latest" for n in names]


def check_think(think: Think | None, info: ModelInfo, model: str) -> None:
    """Ollama refuses ``think`` for a model that cannot think (400, its message); a template that writes
    ``<think>`` can."""
    if think and "<think>" not in info.chat_template:
        raise ApiError(ErrorCode.INVALID_REQUEST, f'"{model}" does not support thinking')


def think_variables(think: Think | None) -> dict[str, Any]:
    """What the chat template reads of ``think`` (Ollama's ``docs/api.md``: ``think`` false asks a thinking
    model not to think): ``enable_thinking`` (the name Qwen3's and other Jinja templates read) false or true;
    unset: nothing, the template's own default."""
    return {} if think is None else {"enable_thinking": bool(think)}


def thinking_parser(services: Services, think: Think | None, prompt: str) -> ReasoningParser | None:
    """The parser that splits the thinking out of an answer whose rendered prompt is ``prompt`` when
    ``think`` asks for it (true or a level: Ollama's ``message.thinking`` / ``thinking``), as llama-server's
    ``reasoning_format: deepseek`` splits it; None (the thinking stays in the content, as Ollama without
    ``think``) otherwise or for a template without thinking tags."""
    if not think:
        return None
    plan = reasoning_of(services, prompt, "deepseek", None, None)
    return plan.parser() if plan is not None else None


def schema_of(fmt: Format | None) -> str:
    """``format`` as the JSON schema text the sampler's grammar is built from (``""``: none): ``"json"`` is
    any JSON object; another string is ``INVALID_REQUEST`` (Ollama's message)."""
    if fmt is None or fmt == "":
        return ""
    if fmt == "json":
        return '{"type": "object"}'
    if isinstance(fmt, dict):
        return json.dumps(fmt)
    raise ApiError(ErrorCode.INVALID_REQUEST, f'invalid format: {fmt!r}; expected "json" or a valid JSON Schema')


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def canonical(
    services: Services,
    request: Request[Any, Any, Any],
    ids: list[int],
    options: Options | None,
    fmt: Format | None,
) -> CanonicalRequest:
    """The generation request of ``ids`` (the rendered prompt's tokens) with Ollama's ``options`` on the
    sampler (a missing option: the server's default, :data:`orchestrator.generation.request.DEFAULT`) and
    ``format`` as its JSON schema, for the caller's tenant and conversation (module docstring)."""
    o = options or Options()
    n_predict = o.num_predict
    slot = request.headers.get("x-slot-id") or None
    key = next((v for h in SESSION_HEADERS if (v := request.headers.get(h))), None)
    return CanonicalRequest(
        request_id=None, input_ids=ids, prompt=None,
        max_new_tokens=remaining(services, len(ids)) if n_predict is None or n_predict < 0 else n_predict,
        temperature=_pick(o.temperature, DEFAULT.temperature), top_p=_pick(o.top_p, DEFAULT.top_p),
        top_k=_pick(o.top_k, DEFAULT.top_k), min_p=_pick(o.min_p, DEFAULT.min_p),
        repeat_penalty=_pick(o.repeat_penalty, DEFAULT.repeat_penalty),
        repeat_last_n=_pick(o.repeat_last_n, DEFAULT.repeat_last_n), seed=_pick(o.seed, DEFAULT.seed),
        stop_tokens=[], banned_tokens=[], stop_strings=list(o.stop or []), ignore_eos=False,
        attention=False, attention_format="aggregated", attention_dtype="float32", attention_layers=None,
        hidden_state=False, n_probs=0, slot=slot, wait=True, token_logprobs=False,  # logprobs: accepted, not given
        presence_penalty=_pick(o.presence_penalty, DEFAULT.presence_penalty),
        frequency_penalty=_pick(o.frequency_penalty, DEFAULT.frequency_penalty),
        typical_p=_pick(o.typical_p, DEFAULT.typical_p), mirostat=_pick(o.mirostat, DEFAULT.mirostat),
        mirostat_tau=_pick(o.mirostat_tau, DEFAULT.mirostat_tau),
        mirostat_eta=_pick(o.mirostat_eta, DEFAULT.mirostat_eta),
        json_schema=schema_of(fmt), n_keep=_pick(o.num_keep, 0),
        principal=principal_of(request), conversation_key=key,
    )  # fmt: skip


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama messages as the chat template reads them (OpenAI's shape, as the tool handling expects):
    an assistant's ``tool_calls`` with their ``arguments`` objects and an id, a ``tool`` message's
    ``tool_name`` as its ``name`` and the id of the call it answers (``tool_call_id``, else the latest
    call of that name), ``thinking`` as ``reasoning_content``.  ``images``: ``INVALID_REQUEST``."""
    out: list[dict[str, Any]] = []
    ids: dict[str, str] = {}  # tool name -> the id of its latest call
    for m in messages:
        if m.images:
            raise ApiError(ErrorCode.INVALID_REQUEST, "image input is not supported: this model reads text only")
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            calls = []
            for i, c in enumerate(m.tool_calls):
                cid = c.id or f"call_{len(out)}_{i}"
                ids[c.function.name] = cid
                fn = {"name": c.function.name, "arguments": c.function.arguments}
                calls.append({"id": cid, "type": "function", "function": fn})
            msg["tool_calls"] = calls
        if m.tool_name:
            msg["name"] = m.tool_name
        if m.role == "tool" and (m.tool_call_id or m.tool_name in ids):
            msg["tool_call_id"] = m.tool_call_id or ids[m.tool_name or ""]
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        out.append(msg)
    return out


def openai_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Ollama's tools in OpenAI's shape (the same: ``{"type": "function", "function": {...}}``)."""
    if not tools:
        return None
    return [
        {"type": t.type, "function": {"name": t.function.name, "description": t.function.description,
                                      "parameters": t.function.parameters}}
        for t in tools
    ]  # fmt: skip


async def chat_prompt(
    services: Services, messages: list[Message], tools: list[Tool] | None, think: Think | None = None
) -> tuple[list[int], ToolPlan | None, str]:
    """The prompt tokens of a chat (its messages and tools rendered by the model's template with ``think``'s
    variables, :func:`think_variables`, as every chat surface renders them:
    :func:`orchestrator.api.common.chat.chat_prompt_ids`), its tool plan (None without tools; with tools,
    Ollama's behaviour: the model may call them or answer) and the prompt's text."""
    return await chat_prompt_ids(
        services, chat_messages(messages), openai_tools(tools), variables=think_variables(think)
    )


async def generate_prompt(
    services: Services, prompt: str, system: str, context: list[int] | None, raw: bool, think: Think | None = None
) -> tuple[list[int], str]:
    """``/api/generate``'s prompt tokens and the text they end with: ``context`` (the ids a previous answer
    returned) followed by ``system`` and ``prompt`` rendered as one turn by the model's chat template with
    ``think``'s variables (BOS only at a conversation's start, unless the template writes it); ``raw``: the
    prompt's own tokens (BOS added as llama-server adds it)."""
    if raw:
        return (await services.engine.tokenize(prompt, True, True)).ids, prompt
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = render_chat(services, msgs, variables=think_variables(think))
    if not context:
        return await chat_ids(services, text), text
    return list(context) + (await services.engine.tokenize(text, False, True)).ids, text


def park_after(services: Services, keep_alive: float | None) -> AfterTurn | None:
    """What a turn does with its slot once answered (Ollama's ``keep_alive``): ``0`` parks it at once, another
    value has it parked once idle that long (:meth:`orchestrator.slots.registry.SlotRegistry.keep_alive`;
    negative: never for being idle), none gives it back to ``--park-idle``; a server without a store to park
    in: nothing."""
    registry = services.registry
    if registry.archive is None:
        return None

    async def park(slot: Slot) -> None:
        registry.keep_alive(slot, keep_alive)
        if keep_alive == 0:
            await registry.park(slot)

    return park


def done_reason(done: DoneOut) -> DoneReason:
    """Ollama's ``done_reason``: ``length`` when the token limit or the window ended it, else ``stop``."""
    return "length" if done.finish_reason == "length" else "stop"


def tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    """Parsed calls as Ollama's ``tool_calls`` (arguments that are not a JSON object: ``{}``)."""
    out = []
    for i, c in enumerate(calls):
        try:
            args = json.loads(c.arguments)
        except ValueError:
            args = {}
        fn = ToolCallFunction(name=c.name, arguments=args if isinstance(args, dict) else {}, index=i)
        out.append(ToolCall(function=fn, id=c.id))
    return out


def metrics(done: DoneOut) -> dict[str, int]:
    """The final chunk's :class:`orchestrator.api.ollama.protocol.Metrics` fields of a generation."""
    return {
        "total_duration": ns(done.generation_time_ms),
        "load_duration": 0,
        "prompt_eval_count": done.n_prompt,
        "prompt_eval_duration": ns(done.t_prefill_ms),
        "eval_count": done.n_generated,
        "eval_duration": ns(done.t_generate_ms),
    }


def chat_chunk(model: str, content: str, calls: list[ToolCall] | None = None, thinking: str = "") -> ChatResponse:
    """A ``/api/chat`` stream line that is not the last (``thinking``: the thinking it carries, if any)."""
    message = Message(role="assistant", content=content)
    if calls:
        message.tool_calls = calls
    if thinking:
        message.thinking = thinking
    return ChatResponse(model=model, created_at=now(), message=message, done=False)


def chat_end(
    model: str, done: DoneOut, content: str = "", calls: list[ToolCall] | None = None, thinking: str = ""
) -> ChatResponse:
    """The last line of a ``/api/chat`` stream (``content`` ""), or the whole answer."""
    end = chat_chunk(model, content, calls, thinking)
    end.done, end.done_reason = True, done_reason(done)
    for name, value in metrics(done).items():
        setattr(end, name, value)
    return end


def generate_chunk(model: str, text: str, thinking: str = "") -> GenerateResponse:
    """A ``/api/generate`` stream line that is not the last (``thinking``: the thinking it carries, if any)."""
    out = GenerateResponse(model=model, created_at=now(), response=text, done=False)
    if thinking:
        out.thinking = thinking
    return out


def generate_end(
    model: str, done: DoneOut, text: str, context: list[int] | None, thinking: str = ""
) -> GenerateResponse:
    """The last line of a ``/api/generate`` stream (``text`` ""), or the whole answer; ``context``: the
    conversation's tokens (None in raw mode, as Ollama)."""
    end = generate_chunk(model, text, thinking)
    end.done, end.done_reason = True, done_reason(done)
    if context is not None:
        end.context = context
    for name, value in metrics(done).items():
        setattr(end, name, value)
    return end


def details(info: ModelInfo) -> ModelDetails:
    """A model's ``details`` from its facts (``quantization_level``: the file type llama.cpp's
    ``llama_model_desc`` ends with)."""
    n = info.n_params
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{round(n / 1e6)}M"
    quant = info.description.split()[-1] if info.description else ""
    return ModelDetails(
        parent_model="", format="gguf", family=info.architecture, families=[info.architecture],
        parameter_size=size, quantization_level=quant,
    )  # fmt: skip


def modified_at(info: ModelInfo) -> str:
    """The model file's modification time (RFC 3339), or now when this process cannot see the file
    (a worker on another machine)."""
    try:
        t = os.path.getmtime(info.model_path)
    except OSError:
        return now()
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def model_info(info: ModelInfo) -> dict[str, Any]:
    """``/api/show``'s ``model_info``: GGUF metadata keys (``general.*``, ``<arch>.*``, ``tokenizer.ggml.*``)."""
    arch = info.architecture
    return {
        "general.architecture": arch,
        "general.parameter_count": info.n_params,
        f"{arch}.context_length": info.n_ctx_train,
        f"{arch}.embedding_length": info.hidden_size,
        f"{arch}.block_count": info.num_layers,
        f"{arch}.attention.head_count": info.num_attention_heads,
        f"{arch}.attention.head_count_kv": info.num_key_value_heads,
        f"{arch}.rope.freq_base": info.rope_freq_base,
        f"{arch}.vocab_size": info.vocab_size,
        "tokenizer.ggml.bos_token_id": info.bos_token_id,
        "tokenizer.ggml.eos_token_id": info.eos_token_id,
    }


def parameters(info: ModelInfo) -> str:
    """The server's sampler defaults and window as Modelfile ``PARAMETER`` lines (``name value``)."""
    values = {
        "num_ctx": info.n_ctx, "temperature": DEFAULT.temperature, "top_k": DEFAULT.top_k,
        "top_p": DEFAULT.top_p, "min_p": DEFAULT.min_p, "repeat_penalty": DEFAULT.repeat_penalty,
        "repeat_last_n": DEFAULT.repeat_last_n,
    }  # fmt: skip
    return "\n".join(f"{name:<30} {value:g}" for name, value in values.items())


def capabilities(info: ModelInfo) -> list[str]:
    """What the model can be asked for on this API: ``completion`` and ``tools`` always (a template without
    tools gets them described, :mod:`orchestrator.generation.tool_calls`), ``thinking`` for a template that
    writes ``<think>``."""
    return ["completion", "tools"] + (["thinking"] if "<think>" in info.chat_template else [])
