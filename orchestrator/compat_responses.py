"""Response bodies of the client-compatible routes as msgspec Structs (the OpenAPI schema's
responses): OpenAI's (API reference: "Chat", "Completions", "Models"), llama-server's
``/completion`` and ``/props`` (llama.cpp ``tools/server/README.md``) and KoboldCpp's
``/api/extra/*`` (KoboldCpp's ``koboldcpp.py``).  Field names and shapes are theirs; a field
typed ``... | UnsetType`` is left out when unset, ``None`` is sent as ``null``.
"""

from __future__ import annotations

import msgspec
from litestar.openapi import ResponseSpec
from msgspec import UNSET, UnsetType

from orchestrator.errors import COMPAT_ERROR_RESPONSES
from orchestrator.responses import Attention, KoboldResult


def streamable(body: type[msgspec.Struct]) -> dict[int, ResponseSpec]:
    """``responses=`` of a route that answers ``body`` as JSON, or server-sent events with
    ``stream: true``, with the error statuses in llama-server's/OpenAI's shape."""
    spec = ResponseSpec(
        body,
        description="the completion; with ``stream: true`` server-sent events (text/event-stream) instead",
        generate_examples=False,
    )
    return {**COMPAT_ERROR_RESPONSES, 200: spec}


# ---------------------------------------------------------------------------------- OpenAI


class ModelMeta(msgspec.Struct, kw_only=True):
    """llama-server's ``meta`` of a model card (context sizes in tokens, size in bytes)."""

    n_ctx_train: int
    n_ctx: int
    n_vocab: int
    n_params: int
    size: int


class ModelCard(msgspec.Struct, kw_only=True):
    """OpenAI's model object, with llama-server's ``aliases`` and ``tags`` (its ``--alias``/``--tags``)
    and ``meta`` (``server-context.cpp`` ``get_res_model_info``)."""

    id: str
    aliases: list[str]
    tags: list[str]
    object: str
    created: int
    owned_by: str
    meta: ModelMeta


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models``: ``{"object": "list", "data": [model]}``."""

    object: str
    data: list[ModelCard]


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of a completion (``cached_tokens``: prompt tokens reused from the slot's KV cache)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobEntry(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes_: list[int] = msgspec.field(name="bytes")


class LogprobEntry(msgspec.Struct, kw_only=True):
    """A chat token's logprob with its alternatives (OpenAI's ``logprobs.content[]``)."""

    token: str
    logprob: float | None
    bytes_: list[int] = msgspec.field(name="bytes")
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[LogprobEntry]


class LegacyLogprobs(msgspec.Struct, kw_only=True):
    """The text completion's ``logprobs`` (OpenAI's legacy shape; ``text_offset`` in characters)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    """A chat completion's choice; ``attention`` (slotserve's extension) per generated token."""

    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | UnsetType = UNSET
    attention: list[Attention | None] | UnsetType = UNSET


class TextChoice(msgspec.Struct, kw_only=True):
    """A text completion's choice; ``attention`` (slotserve's extension) per generated token."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: LegacyLogprobs | None
    attention: list[Attention | None] | UnsetType = UNSET


class ChatCompletion(msgspec.Struct, kw_only=True):
    """``POST /v1/chat/completions`` without ``stream`` (``slot_id``: slotserve's extension)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    slot_id: int | str


class TextCompletion(msgspec.Struct, kw_only=True):
    """``POST /v1/completions`` without ``stream`` (``slot_id``: slotserve's extension)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage
    slot_id: int | str


# ---------------------------------------------------------------------------------- llama-server


class TokenProb(msgspec.Struct, kw_only=True):
    id: int
    token: str
    bytes_: list[int] = msgspec.field(name="bytes")
    logprob: float


class CompletionProb(msgspec.Struct, kw_only=True):
    """llama-server's ``completion_probabilities[]`` entry (``n_probs``)."""

    id: int
    token: str
    bytes_: list[int] = msgspec.field(name="bytes")
    logprob: float | None
    top_logprobs: list[TokenProb]


class Timings(msgspec.Struct, kw_only=True):
    """llama-server's ``timings``: prompt and generation counts (tokens), times (ms) and rates."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class LogitBiasEntry(msgspec.Struct, kw_only=True):
    """One logit bias as llama-server reports it (``task_params::format_logit_bias``); null (its JSON for
    ``-inf``): a banned token."""

    bias: float | None
    token: int


class SamplerSettings(msgspec.Struct, kw_only=True):
    """llama-server's ``params`` / ``generation_settings`` (``n_ctx`` in ``generation_settings`` only)."""

    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_last_n: int
    repeat_penalty: float
    max_tokens: int
    n_predict: int
    ignore_eos: bool
    n_probs: int
    stop: list[str]
    presence_penalty: float
    frequency_penalty: float
    typical_p: float
    top_n_sigma: float
    xtc_probability: float
    xtc_threshold: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_sequence_breakers: list[str]
    dynatemp_range: float
    dynatemp_exponent: float
    mirostat: int
    mirostat_tau: float
    mirostat_eta: float
    grammar: str
    logit_bias: list[LogitBiasEntry]
    samplers: list[str]
    n_ctx: int | UnsetType = UNSET


class LlamaCompletion(msgspec.Struct, kw_only=True):
    """llama-server's ``POST /completion`` without ``stream`` (``stop: true``)."""

    index: int
    content: str
    tokens: list[int]
    id_slot: int | str
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: SamplerSettings
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: str
    stopping_word: str | None
    tokens_cached: int
    timings: Timings
    completion_probabilities: list[CompletionProb] | UnsetType = UNSET


class DefaultSettings(msgspec.Struct, kw_only=True):
    params: SamplerSettings
    n_ctx: int


class Modalities(msgspec.Struct, kw_only=True):
    vision: bool
    video: bool
    audio: bool


class Props(msgspec.Struct, kw_only=True):
    """llama-server's ``GET /props``."""

    default_generation_settings: DefaultSettings
    total_slots: int
    model_alias: str
    model_path: str
    modalities: Modalities
    endpoint_slots: bool
    endpoint_props: bool
    endpoint_metrics: bool
    chat_template: str
    bos_token: str | int
    eos_token: str | int
    build_info: str
    is_sleeping: bool


# ---------------------------------------------------------------------------------- KoboldCpp


class KoboldVersion(msgspec.Struct, kw_only=True):
    """``GET /api/extra/version``: ``result`` is "KoboldCpp" (clients check it), with feature flags."""

    result: str
    version: str
    protected: bool
    txt2img: bool
    vision: bool
    transcribe: bool
    multiplayer: bool
    websearch: bool
    tts: bool
    embeddings: bool
    server: str


class KoboldResultValue(msgspec.Struct, kw_only=True):
    """``{"result": ...}`` (``/api/v1/info/version``)."""

    result: str


class KoboldValue(msgspec.Struct, kw_only=True):
    """``{"value": n}`` (KoboldCpp's config endpoints: tokens)."""

    value: int


class KoboldTokenCount(msgspec.Struct, kw_only=True):
    """``POST /api/extra/tokencount``: the count and the ids."""

    value: int
    ids: list[int]


class KoboldAbort(msgspec.Struct, kw_only=True):
    """``POST /api/extra/abort``: KoboldCpp answers the strings "true"/"false"."""

    success: str
    done: str


class KoboldPending(msgspec.Struct, kw_only=True):
    """``/api/extra/generate/check``: the text generated so far."""

    results: list[KoboldResult]


class KoboldPerf(msgspec.Struct, kw_only=True):
    """``GET /api/extra/perf``: the last generation's times (s) and counts, and server status."""

    last_process: float
    last_eval: float
    last_token_count: int
    last_seed: int
    total_gens: int
    stop_reason: int
    total_img_gens: int
    queue: int
    idle: int
    hordeexitcounter: int
    uptime: float
    idletime: float
    quiet: bool
