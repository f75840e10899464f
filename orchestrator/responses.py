"""The JSON bodies the HTTP routes answer, as msgspec Structs (the OpenAPI schema's responses).

Field names and shapes are the clients': llama-server's slot API and ``/props``
(llama.cpp ``tools/server/README.md``), KoboldCpp's ``/api/extra/*`` (KoboldCpp's
``koboldcpp.py``), OpenAI's objects (OpenAI API reference) and this server's
(docs/api.md).  A field typed ``... | UnsetType`` is left out of the body when unset
(msgspec omits ``UNSET``), as the dict-built bodies did; ``None`` is sent as ``null``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar.openapi import ResponseSpec
from msgspec import UNSET, UnsetType

from engine.errors import ErrorCode
from orchestrator import wire
from orchestrator.errors import ERROR_RESPONSES
from orchestrator.generation import TokenOut


class TokenText(msgspec.Struct, kw_only=True):
    """A token and its text; ``bytes`` (the raw piece) when the piece alone is not valid UTF-8."""

    token_id: int
    text: str
    bytes_: list[int] | UnsetType = msgspec.field(default=UNSET, name="bytes")


class Attention(msgspec.Struct, kw_only=True):
    """One token's attention (docs/api.md, "Attention"): ``shape`` ``[n_layers, n_heads, context_length]``
    (``per_layer``) or ``[context_length]`` (``aggregated``), ``data`` base64 of ``dtype`` values."""

    format: str
    shape: list[int]
    context_length: int
    encoding: str
    dtype: str
    data: str


class TokenAttention(TokenText, kw_only=True):
    """A token with its attention (``attention_data`` entries)."""

    attention: Attention | None


class SseEvent(msgspec.Struct, kw_only=True):
    """One server-sent event as a client's parser reads it (WHATWG HTML, "Server-sent events"):
    ``data`` is one JSON object (docs/api.md), ``event`` its type (``message``)."""

    data: str
    event: str | UnsetType = UNSET
    id: str | UnsetType = UNSET
    retry: int | UnsetType = UNSET


def event_stream(description: str) -> dict[int, ResponseSpec]:
    """``responses=`` of a route that answers server-sent events (``text/event-stream``; the schema is
    that of each event, :class:`SseEvent`) or an error body before the stream starts."""
    spec = ResponseSpec(SseEvent, description=description, media_type="text/event-stream", generate_examples=False)
    return {**ERROR_RESPONSES, 200: spec}


def token_text(t: TokenOut) -> TokenText:
    """:class:`TokenText` of a generated token."""
    return msgspec.convert(wire.token_text_fields(t), TokenText)


def token_attention(t: TokenOut, fmt: str, dtype: str) -> TokenAttention:
    """:class:`TokenAttention` of a generated token (``fmt``/``dtype`` as requested)."""
    fields = wire.token_text_fields(t) | {"attention": wire.attention_json(t, fmt, dtype)}
    return msgspec.convert(fields, TokenAttention)


# ---------------------------------------------------------------------------------- model, tokens


class ModelResponse(msgspec.Struct, kw_only=True):
    """``GET /api/v1/model`` and ``/api/v1/model/info`` (docs/api.md, "Model"): the GGUF's facts
    under both seeds' names (``result``/``model_name``, ``max_context_length``/``context_length``...);
    ``attention_layers`` the layers attention tensors cover, ``attention_windows`` each one's sliding
    window (0: global), ``memory`` what the model keeps per sequence (docs/models.md); ``engine`` the
    worker's runtime settings (threads, batch sizes, KV cache type)."""

    result: str
    model_name: str
    model_path: str
    architecture: str
    description: str
    fingerprint: str
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    embedding_size: int
    max_position_embeddings: int
    max_trained_context: int
    max_context_length: int
    context_length: int
    rope_theta: float
    rope_freq_base: float
    rope_freq_scale: float
    bos_token_id: int
    eos_token_id: int
    eot_token_id: int
    eog_token_ids: list[int]
    special_tokens: dict[str, str | int]
    chat_template: str
    torch_dtype: str
    n_params: int
    size_bytes: int
    n_slots: int
    n_kv_cells: int
    attention_layers: list[int]
    attention_windows: list[int]
    memory: dict[str, Any]
    llama_cpp_python: str
    engine: dict[str, Any]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    """``POST /api/v1/tokenize``: ids, count and (unless ``with_pieces: false``) each token's text."""

    token_ids: list[int]
    token_count: int
    tokens: list[TokenText] | UnsetType = UNSET


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    """``POST /api/v1/detokenize``."""

    text: str


class TokenPiece(msgspec.Struct, kw_only=True):
    """llama-server's ``with_pieces`` entry: ``piece`` is the text, or its bytes when not valid UTF-8."""

    id: int
    piece: str | list[int]


class LlamaTokenizeResponse(msgspec.Struct, kw_only=True):
    """llama-server's ``POST /tokenize``: ids, or :class:`TokenPiece` entries with ``with_pieces``."""

    tokens: list[int | TokenPiece]


class LlamaDetokenizeResponse(msgspec.Struct, kw_only=True):
    """llama-server's ``POST /detokenize``."""

    content: str


# ---------------------------------------------------------------------------------- health


class HealthError(msgspec.Struct, kw_only=True):
    """llama-server's 503 body of ``/health``: ``{"code": 503, "message": "Loading model"}``."""

    code: int
    message: str


class HealthResponse(msgspec.Struct, kw_only=True):
    """``GET /health`` (docs/api.md, "Health"): ``status`` ok, degraded (store down), loading or
    down; with 503 also llama-server's ``error`` and the start-up ``stage`` (and ``progress``,
    0..1, while the model loads)."""

    status: str
    engine: str
    store: str
    slots_idle: int
    slots_processing: int
    engine_config: dict[str, Any] | UnsetType = UNSET
    classifier: str | UnsetType = UNSET
    error: HealthError | UnsetType = UNSET
    error_code: ErrorCode | UnsetType = UNSET
    stage: str | UnsetType | None = UNSET
    progress: float | UnsetType = UNSET


# ---------------------------------------------------------------------------------- generate


class Hidden(msgspec.Struct, kw_only=True):
    """A generated token's hidden state: ``shape`` ``[n_embd]``, base64 float32 ``data``."""

    shape: list[int]
    encoding: str
    dtype: str
    data: str


class TopLogprob(msgspec.Struct, kw_only=True):
    """One of a token's most likely alternatives, best first."""

    token_id: int
    logprob: float
    text: str | UnsetType = UNSET


class GeneratedToken(TokenText, kw_only=True):
    """A generated token of ``POST /api/v1/generate``: its logprob, alternatives (``n_probs``)
    and hidden state (``output_hidden_states``)."""

    logprob: float | None
    top_logprobs: list[TopLogprob] | UnsetType = UNSET
    hidden_state: Hidden | UnsetType = UNSET


class KoboldResult(msgspec.Struct, kw_only=True):
    """KoboldCpp's ``results`` entry (``finish_reason`` length, stop or abort)."""

    text: str
    finish_reason: str | UnsetType | None = UNSET


class GenerateResponse(msgspec.Struct, kw_only=True):
    """``POST /api/v1/generate`` (docs/api.md): the ``done`` event's fields, every generated token,
    the text, KoboldCpp's ``results``, and ``attention_data`` when attention was asked for."""

    type: str
    request_id: str | None
    finish_reason: str
    total_tokens: int
    generation_time_ms: float
    prompt_tokens: int
    cached_tokens: int
    slot_id: int | str
    stop_string: str | UnsetType = UNSET
    generated_tokens: list[GeneratedToken]
    generated_text: str
    results: list[KoboldResult]
    attention_data: list[TokenAttention] | UnsetType = UNSET


class MessageSpan(msgspec.Struct, kw_only=True):
    """A message's token range, ``start``..``end`` inclusive (``index`` from 0)."""

    index: int
    start: int
    end: int


class SlotMessage(MessageSpan, kw_only=True):
    """A message of a slot with its text."""

    text: str


class SlotMessages(msgspec.Struct, kw_only=True):
    """``GET /admin/api/slots/{id}/messages``: a slot's messages as text with token ranges."""

    id_slot: int | str
    n_tokens: int
    boundary_eot: int
    messages: list[SlotMessage]


# ---------------------------------------------------------------------------------- preview


class PreviewResponse(msgspec.Struct, kw_only=True):
    """``POST /api/v1/generate/preview`` (docs/api.md): ``stopped_reason`` max_tokens, stop_token,
    stop_string or cancelled; ``slot_id`` the forked slot (``null`` without a cache hit);
    ``attention_data`` only with ``output_attentions``."""

    text: str
    tokens: list[TokenText]
    token_count: int
    stopped_reason: str
    cache_hit: bool
    generation_time_ms: float
    n_prefilled: int
    n_cached: int
    slot_id: int | str | None
    attention_data: list[TokenAttention] | UnsetType = UNSET


# ---------------------------------------------------------------------------------- slots


class SlotEntry(msgspec.Struct, kw_only=True):
    """One entry of ``GET /slots`` (docs/api.md, "Slots"): llama-server's ``id``, ``n_ctx``,
    ``is_processing`` and its task fields (resident slots), plus where the slot lives
    (``place``: resident, parked, empty), its sizes in bytes and timestamps; ``named``: a
    slotserve conversation beyond llama-server's ``n_parallel`` numbered slots."""

    id: int | str
    n_ctx: int
    is_processing: bool
    n_tokens: int
    place: str
    stored_bytes: int | None
    state_bytes: int | None
    codec: str | UnsetType = UNSET
    updated_at: float | UnsetType = UNSET
    seq: int | UnsetType | None = UNSET
    stored: bool | UnsetType = UNSET
    dirty: bool | UnsetType = UNSET
    idle_s: float | UnsetType = UNSET
    speculative: bool | UnsetType = UNSET
    id_task: int | UnsetType = UNSET
    n_prompt_tokens: int | UnsetType = UNSET
    n_prompt_tokens_processed: int | UnsetType = UNSET
    n_prompt_tokens_cache: int | UnsetType = UNSET
    params: dict[str, Any] | UnsetType = UNSET
    next_token: list[dict[str, Any]] | UnsetType = UNSET
    named: bool | UnsetType = UNSET


class SlotInfo(msgspec.Struct, kw_only=True):
    """``GET /v1/slots/{id}/info``: tokens and message boundaries at the end-of-turn token."""

    id_slot: int | str
    n_tokens: int
    boundary_eot: int
    n_messages: int
    messages: list[MessageSpan]


class SaveStateResponse(msgspec.Struct, kw_only=True):
    """``?action=save-state`` as JSON: the SES1 blob in base64 with its ``Repr-Digest`` (RFC 9530)."""

    id_slot: int | str
    n_tokens: int
    n_bytes: int
    t_ms: float
    state: str
    digest: str


class RestoreStateResponse(msgspec.Struct, kw_only=True):
    """``?action=restore-state``."""

    id_slot: int | str
    n_bytes_read: int
    success: bool
    t_ms: float


class TokensResponse(msgspec.Struct, kw_only=True):
    """``?action=tokens``: the slot's tokens."""

    id_slot: int | str
    n_tokens: int
    tokens: list[int]
    n_prompt_tokens_processed: int


class ContextShiftResponse(msgspec.Struct, kw_only=True):
    """``?action=context-shift``: the token count after the shift."""

    id_slot: int | str
    success: bool
    new_n_tokens: int


class EraseResponse(msgspec.Struct, kw_only=True):
    """``?action=erase`` (llama-server's ``n_erased``)."""

    id_slot: int | str
    n_erased: int


class SaveTimings(msgspec.Struct, kw_only=True):
    save_ms: float


class RestoreTimings(msgspec.Struct, kw_only=True):
    restore_ms: float


class SaveFileResponse(msgspec.Struct, kw_only=True):
    """``?action=save`` (llama-server's ``n_saved``, ``n_written``, ``timings.save_ms``)."""

    id_slot: int | str
    filename: str
    n_saved: int
    n_written: int
    timings: SaveTimings


class RestoreFileResponse(msgspec.Struct, kw_only=True):
    """``?action=restore`` (llama-server's ``n_restored``, ``n_read``, ``timings.restore_ms``)."""

    id_slot: int | str
    filename: str
    n_restored: int
    n_read: int
    timings: RestoreTimings


class ForkResponse(msgspec.Struct, kw_only=True):
    """``?action=fork``: the new slot ``target`` and its token count."""

    id_slot: int | str
    target: int | str
    n_tokens: int
    success: bool


SlotActionResponse = (
    SaveStateResponse
    | RestoreStateResponse
    | TokensResponse
    | ContextShiftResponse
    | EraseResponse
    | SaveFileResponse
    | RestoreFileResponse
    | ForkResponse
)
"""What ``POST /slots/{id}`` answers, by action (``save-state`` with ``Accept:
application/octet-stream``: the raw SES1 bytes instead)."""
