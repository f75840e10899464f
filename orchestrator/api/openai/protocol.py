"""The OpenAI-compatible API's request bodies, response bodies and stream chunks.

Shapes are OpenAI's (API reference: "Chat", "Completions", "Models") as llama-server serves them
(llama.cpp ``tools/server/server-task.cpp``: ``to_json_oaicompat*``).  A field typed ``... | UnsetType`` is
left out when unset; ``None`` is sent as ``null``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from contract.errors import ErrorCode
from contract.options import AttentionDtype, AttentionFormat
from orchestrator.api.common.completion import LlamaCompletion
from orchestrator.api.common.timings import Timings
from orchestrator.api.common.wire import Attention, PromptProgress
from orchestrator.generation.request import (
    Float32,
    NonNegFloat32,
    Probability,
    SamplerFields,
    Seed,
    TokenCount,
    TopK,
)
from orchestrator.tenants.conversation import PromptCacheKey
from orchestrator.web.errors import ApiError


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
    """One alternative of a chat token: OpenAI's ``top_logprobs[]`` (``token``, ``logprob``, ``bytes``), or
    with llama-server's ``post_sampling_probs`` its ``top_probs[]`` (``id``, ``token``, ``bytes``, ``prob``)."""

    id: int | UnsetType = UNSET
    token: str
    logprob: float | UnsetType = UNSET
    bytes_: list[int] = msgspec.field(name="bytes")
    prob: float | UnsetType = UNSET


class LogprobEntry(msgspec.Struct, kw_only=True):
    """A chat token's logprob with its alternatives (OpenAI's ``logprobs.content[]``: ``token``, ``logprob``,
    ``bytes``, ``top_logprobs``); with llama-server's ``post_sampling_probs`` its ``id``, ``token``, ``bytes``,
    ``prob`` and ``top_probs``, the probabilities after the sampler chain (``tools/server/server-task.cpp``
    ``completion_token_output::probs_vector_to_json``), in place of ``logprob`` and ``top_logprobs``."""

    id: int | UnsetType = UNSET
    token: str
    logprob: float | UnsetType | None = UNSET
    bytes_: list[int] = msgspec.field(name="bytes")
    top_logprobs: list[TopLogprobEntry] | UnsetType = UNSET
    prob: float | UnsetType = UNSET
    top_probs: list[TopLogprobEntry] | UnsetType = UNSET


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[LogprobEntry]


class LegacyLogprobs(msgspec.Struct, kw_only=True):
    """The text completion's ``logprobs`` (OpenAI's legacy shape; ``text_offset`` in characters)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(msgspec.Struct, kw_only=True):
    """A tool call's function: ``arguments`` is JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    """One of an assistant message's ``tool_calls`` (OpenAI Chat Completions)."""

    id: str
    type: str
    function: FunctionCall


class FunctionDelta(msgspec.Struct, kw_only=True):
    """A streamed tool call's function: ``name`` on the call's first delta (with ``arguments`` ""),
    then pieces of ``arguments`` (JSON text) that concatenate to the call's arguments."""

    name: str | UnsetType = UNSET
    arguments: str


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A tool call in a streamed chunk's ``delta.tool_calls`` (``index``: which call), as OpenAI and
    llama-server stream them (``server_chat_msg_diff_to_json_oaicompat``, ``tools/server/server-chat.cpp``):
    the call's first delta has ``id``, ``type: "function"`` and ``function.name``, the next ones only
    ``function.arguments`` pieces."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionDelta


class ChatMessage(msgspec.Struct, kw_only=True):
    """The assistant's message: ``content`` is null when the answer is only tool calls; ``reasoning_content``
    the model's thinking, split out by ``reasoning_format`` (llama-server's, absent when there is none)."""

    role: str
    content: str | None
    reasoning_content: str | UnsetType = UNSET  # llama-server's: the thinking (reasoning_format), when there is one
    tool_calls: list[ToolCallOut] | UnsetType = UNSET


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
    """``POST /v1/chat/completions`` without ``stream`` (``slot_id``: slotserve's extension; ``__verbose``:
    llama-server's, with ``verbose: true``, its ``/completion`` answer of the same generation)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    slot_id: int | str
    verbose: LlamaCompletion | UnsetType = msgspec.field(default=UNSET, name="__verbose")


class TextCompletion(msgspec.Struct, kw_only=True):
    """``POST /v1/completions`` without ``stream`` (``slot_id``: slotserve's extension; ``__verbose`` as in
    :class:`ChatCompletion`)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage
    slot_id: int | str
    verbose: LlamaCompletion | UnsetType = msgspec.field(default=UNSET, name="__verbose")


# Stream chunks (``stream: true``): ``data: {json}`` server-sent events ending ``data: [DONE]``, as OpenAI's
# API reference ("The chat completion chunk object") and llama-server (``to_json_oaicompat*_stream``) send them.


class ChatDelta(msgspec.Struct, kw_only=True):
    """What a chat chunk adds: the first chunk ``role`` (and ``content: null``, as llama-server), then
    ``reasoning_content``, ``content`` or ``tool_calls`` pieces; the last chunk an empty delta with
    ``finish_reason``."""

    role: str | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    """A chat chunk's choice ``index`` (``n`` > 1: one per choice); ``attention`` per token (extension)."""

    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | UnsetType = UNSET
    attention: list[Attention | None] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One streamed chat chunk (``object``: ``chat.completion.chunk``); the last one before ``[DONE]`` has
    no choices and the ``usage`` when ``stream_options.include_usage``.

    llama-server's extras (``server-task.cpp``, ``to_json_oaicompat_chat*``), each only when asked for:
    ``timings`` (``timings_per_token``: on every chunk after the first, the last one's final),
    ``prompt_progress`` (``return_progress``: chunks with the role delta, one per prefill step before the
    first token) and ``__verbose`` (``verbose``: on the finishing chunk, llama-server's ``/completion``
    final answer of the generation, its ``content`` empty as in a stream)."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET
    prompt_progress: PromptProgress | UnsetType = UNSET
    verbose: LlamaCompletion | UnsetType = msgspec.field(default=UNSET, name="__verbose")


class TextCompletionChunk(msgspec.Struct, kw_only=True):
    """One streamed text completion chunk (``object``: ``text_completion``, as OpenAI streams them), with
    llama-server's ``timings``, ``prompt_progress`` (a chunk of empty text) and ``__verbose`` as in
    :class:`ChatCompletionChunk`."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET
    prompt_progress: PromptProgress | UnsetType = UNSET
    verbose: LlamaCompletion | UnsetType = msgspec.field(default=UNSET, name="__verbose")


MAX_TOP_LOGPROBS = 20


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage``."""

    include_usage: bool = False


class AttentionOption(msgspec.Struct, kw_only=True):
    """slotserve extension: attention per generated token (see docs/api.md, "Attention")."""

    format: AttentionFormat = "aggregated"
    dtype: AttentionDtype = "float32"
    layers: list[int] | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: the schema the output must match (``name``/``strict`` are not used)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] = {}
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object; llama-server also takes a
    ``schema`` here) or ``json_schema``; turned into a grammar as llama-server does (``json_schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema: dict[str, Any] | None = None

    def schema_json(self) -> dict[str, Any] | None:
        """The JSON schema to constrain the output with (``{}``: any object), or None for ``text``."""
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ApiError(ErrorCode.INVALID_REQUEST, 'response_format of type "json_schema" needs json_schema')
            return self.json_schema.schema
        return (self.schema or {}) if self.type == "json_object" else None


ReasoningBudget = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
"""A thinking budget in tokens: -1 unlimited, 0 ended at once (llama-server's ``reasoning_budget_tokens``)."""


class OpenAIRequest(SamplerFields, kw_only=True):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions`` (plus llama-server's extras,
    :class:`orchestrator.schemas.SamplerFields`, as llama-server takes them on these routes too)."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Float32 | None = None
    top_p: Probability | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    prompt_cache_key: PromptCacheKey | None = None  # OpenAI's conversation key (docs/api.md)
    slot_id: str | int | None = None
    attention: AttentionOption | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    repeat_penalty: NonNegFloat32 | None = None
    ignore_eos: bool = False
    timings_per_token: bool = False
    return_progress: bool = False
    verbose: bool = False


class ChatCompletionRequest(OpenAIRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    post_sampling_probs: bool = False  # llama-server's: logprobs as probabilities after the sampler chain
    # llama-server's reasoning fields (its README): none/auto/deepseek (None: --reasoning-format), a thinking
    # budget in tokens (-1 or None: --reasoning-budget) and the message forced before the end tag when it is spent
    reasoning_format: str | None = None
    reasoning_budget_tokens: ReasoningBudget | None = None
    thinking_budget_tokens: ReasoningBudget | None = None
    reasoning_budget_message: str | None = None
    # llama-server's: more variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(OpenAIRequest, kw_only=True):
    """``POST /v1/completions`` (``logprobs`` is the legacy count of top alternatives, 0..5)."""

    prompt: str | list[int | str | list[int | str]]  # a list holding no number: several prompts
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


# ---------------------------------------------------------------------------------- Responses API


# Streaming events of the Responses API (OpenAI's API reference, "Responses streaming"): each is sent as
# ``event: <type>`` + ``data: {json}`` (orchestrator.web.sse.named_event) and numbered by
# ``sequence_number`` from 0.


# ---------------------------------------------------------------------------------- embeddings


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings body (``dimensions`` and ``user`` are accepted and not used)."""

    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class Embedding(msgspec.Struct, kw_only=True):
    """One input's vector (``float[n_embd]``, or its float32 bytes in base64)."""

    object: str
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(msgspec.Struct, kw_only=True):
    """Tokens read (every input, special tokens included)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings``: one :class:`Embedding` per input, in input order."""

    object: str
    model: str
    data: list[Embedding]
    usage: EmbeddingsUsage
