"""slotserve's native API: its request bodies, response bodies and stream events (docs/api.md).

msgspec Structs: validated when decoded, encoded by msgspec, published in the OpenAPI schema.  A field typed
``... | UnsetType`` is left out of the body when unset; ``None`` is sent as ``null``.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from contract.errors import ErrorCode
from contract.model_facts import ModelFacts
from contract.options import GRAPH_FORMATS
from orchestrator.api.common.kobold import KoboldResult
from orchestrator.api.common.wire import (
    Attention,
    ContextShift,
    PromptProgress,
    TokenText,
    attention_of,
    context_shift_of,
    token_text,
)
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.slots.model import slot_id_out
from orchestrator.web.errors import ErrorEvent


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /api/v1/tokenize`` and llama-server's ``/tokenize`` (``content``)."""

    text: str | None = None
    content: str | None = None
    add_special_tokens: bool = False
    add_special: bool | None = None
    parse_special: bool = True
    with_pieces: bool | None = None  # default: true on /api/v1/tokenize, false on /tokenize


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /api/v1/detokenize`` (``token_ids``) and llama-server's ``/detokenize`` (``tokens``)."""

    token_ids: list[int] | None = None
    tokens: list[int] | None = None


class TokenAttention(TokenText, kw_only=True):
    """A token with its attention (``attention_data`` entries)."""

    attention: Attention | None


def token_attention(t: TokenOut, fmt: str, dtype: str) -> TokenAttention:
    """:class:`TokenAttention` of a generated token (``fmt``/``dtype`` as requested)."""
    tt = token_text(t)
    return TokenAttention(token_id=tt.token_id, text=tt.text, bytes_=tt.bytes_, attention=attention_of(t, fmt, dtype))


class ModelResponse(ModelFacts, kw_only=True):
    """``GET /api/v1/model`` and ``/api/v1/model/info`` (docs/api.md, "Model"): the GGUF's facts
    (:class:`contract.model_facts.ModelFacts`) and the same under both seeds' names (``result``/``model_name``,
    ``max_context_length``/``context_length``...); ``memory`` what the model keeps per sequence
    (docs/models.md); ``engine`` the worker's runtime settings (threads, batch sizes, KV cache type)."""

    result: str
    embedding_size: int
    max_position_embeddings: int
    max_trained_context: int
    max_context_length: int
    context_length: int
    rope_theta: float
    torch_dtype: str
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


def hidden_of(t: TokenOut) -> Hidden | UnsetType:
    """A token's hidden state (``output_hidden_states``; Halo Weave): float32 ``[n_embd]``, base64; unset without."""
    if t.hidden is None:
        return UNSET
    data = base64.b64encode(t.hidden).decode("ascii")
    return Hidden(shape=[len(t.hidden) // 4], encoding="base64", dtype="float32", data=data)


def top_logprobs_of(t: TokenOut, pieces: list[bytes] | None = None) -> list[TopLogprob]:
    """A token's most likely alternatives, best first; with ``pieces`` (token id -> bytes) their text."""
    if pieces is None:
        return [TopLogprob(token_id=tok, logprob=lp) for tok, lp in t.top]
    return [TopLogprob(token_id=tok, logprob=lp, text=pieces[tok].decode("utf-8", "replace")) for tok, lp in t.top]


class GeneratedToken(TokenText, kw_only=True):
    """A generated token of ``POST /api/v1/generate``: its logprob, alternatives (``n_probs``)
    and hidden state (``output_hidden_states``)."""

    logprob: float | None
    top_logprobs: list[TopLogprob] | UnsetType = UNSET
    hidden_state: Hidden | UnsetType = UNSET


class DoneFields(msgspec.Struct, kw_only=True):
    """How a generation ended (docs/api.md, "``done`` fields"): token counts, milliseconds, the slot; the
    ``done`` event's fields and the first of ``POST /api/v1/generate``'s answer."""

    request_id: str | None
    finish_reason: str
    total_tokens: int
    generation_time_ms: float
    prompt_tokens: int
    cached_tokens: int
    slot_id: int | str
    stop_string: str | UnsetType = UNSET
    truncated: bool | UnsetType = UNSET  # the context shifted (or the generation ended at the window)


class GenerateResponse(DoneFields, kw_only=True):
    """``POST /api/v1/generate`` (docs/api.md): the ``done`` event's fields (:class:`DoneFields`, ``type``
    ``done``), every generated token, the text, KoboldCpp's ``results``, and ``attention_data`` when attention
    was asked for."""

    type: str = "done"
    generated_tokens: list[GeneratedToken]
    generated_text: str
    results: list[KoboldResult]
    attention_data: list[TokenAttention] | UnsetType = UNSET


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


class ClassifyRequest(msgspec.Struct, kw_only=True):
    """TEI input: one text or a list of texts."""

    inputs: str | list[str]


class Prediction(msgspec.Struct):
    """One label's raw logit."""

    label: str
    score: float


class ClassifyUsage(msgspec.Struct):
    """Tokens the classifier read (all inputs, special tokens included)."""

    prompt_tokens: int
    total_tokens: int


class ClassifyResponse(msgspec.Struct):
    """Predictions, best first: ``list[Prediction]`` for a string input, ``list[list[Prediction]]``
    (one list per input, in order) for a list input (msgspec cannot type that union)."""

    model: str
    usage: ClassifyUsage
    predictions: list[Any]
    object: str = "list"


# ---------------------------------------------------------------------------------- stream events
# What the SSE stream (``POST /api/extra/generate/stream`` with attention) and the WebSockets send, one
# Struct per event (docs/api.md, "Streaming"); ``type`` tells them apart.  Built from generation's
# events (:mod:`orchestrator.generation.events`) by the functions below, encoded by msgspec.


class StreamToken(TokenText, kw_only=True):
    """The ``token`` of a JSON WebSocket ``token`` event: its logprob and alternatives (best first)."""

    logprob: float | None
    top_logprobs: list[TopLogprob]


class TokenEvent(msgspec.Struct, kw_only=True, tag="token", tag_field="type"):
    """``WS /api/v1/generate/stream``: one generated token (``index`` from 0), its attention and hidden
    state when asked for."""

    request_id: str | None
    index: int
    token: StreamToken
    attention: Attention | UnsetType = UNSET
    hidden_state: Hidden | UnsetType = UNSET


class SseTokenEvent(msgspec.Struct, kw_only=True, tag="token", tag_field="type"):
    """``POST /api/extra/generate/stream`` with attention: one generated token and its attention."""

    token: TokenText
    request_id: str | None
    attention: Attention | None
    hidden_state: Hidden | UnsetType = UNSET


class BinaryTokenFrame(msgspec.Struct, kw_only=True, tag="token", tag_field="type"):
    """``WS /api/extra/generate/stream/ws``: the JSON text frame before a token's binary attention frame
    (raw ``attention_dtype`` values of ``shape``; no binary frame when ``shape`` is absent).  Reduced formats
    (docs/api.md, "Attention formats"): ``positions`` true (``topk``) says a second binary frame of ``int32``
    positions of ``shape`` follows; ``context_length`` the row's length; ``sink`` the sink figure."""

    token_id: int
    text: str
    bytes_: list[int] | UnsetType = msgspec.field(default=UNSET, name="bytes")
    index: int
    shape: list[int] | UnsetType = UNSET
    hidden_state: Hidden | UnsetType = UNSET
    context_shift: ContextShift | UnsetType = UNSET
    positions: bool | UnsetType = UNSET
    context_length: int | UnsetType = UNSET
    sink: float | UnsetType = UNSET


class ProgressEvent(msgspec.Struct, kw_only=True, tag="progress", tag_field="type"):
    """Prompt-processing progress, before the first token (``return_progress``)."""

    request_id: str | None
    prompt_progress: PromptProgress


class QueuedEvent(msgspec.Struct, kw_only=True, tag="queued", tag_field="type"):
    """On the WebSockets, while a request waits for a free engine sequence: its place (1 = next)."""

    position: int
    request_id: str | None


class DoneEvent(DoneFields, kw_only=True, tag="done", tag_field="type"):
    """The last event of a generation (docs/api.md, "``done`` fields"): token counts, milliseconds, the slot."""


StreamEvent = TokenEvent | SseTokenEvent | BinaryTokenFrame | ProgressEvent | QueuedEvent | DoneEvent | ErrorEvent
"""Every event slotserve's native streams send (one ``token`` shape per stream)."""


def payload_bytes(t: TokenOut) -> int:
    """The raw bytes a token's event carries base64-encoded (attention, its positions and hidden state)."""
    return len(t.attention or b"") + len(t.positions or b"") + len(t.hidden or b"")


def token_event(t: TokenOut, request_id: str | None, fmt: str, dtype: str, pieces: list[bytes]) -> TokenEvent:
    """The JSON WebSocket's ``token`` event of ``t`` (``pieces``: token id -> bytes, for alternatives' text)."""
    tt = token_text(t)
    token = StreamToken(
        token_id=tt.token_id, text=tt.text, bytes_=tt.bytes_, logprob=t.logprob, top_logprobs=top_logprobs_of(t, pieces)
    )
    att = attention_of(t, fmt, dtype)
    return TokenEvent(
        request_id=request_id,
        index=t.index,
        token=token,
        attention=UNSET if att is None else att,
        hidden_state=hidden_of(t),
    )


def sse_token_event(t: TokenOut, request_id: str | None, fmt: str, dtype: str) -> SseTokenEvent:
    """The SSE stream's token event with attention."""
    att = attention_of(t, fmt, dtype)
    return SseTokenEvent(token=token_text(t), request_id=request_id, attention=att, hidden_state=hidden_of(t))


def binary_token_frame(t: TokenOut, fmt: str) -> BinaryTokenFrame:
    """The binary WebSocket's text frame of ``t``, whose attention is in format ``fmt``."""
    tt = token_text(t)
    shape = UNSET if t.attention is None else t.attention_shape
    reduced = t.attention is not None and (fmt not in GRAPH_FORMATS or t.sink is not None)
    return BinaryTokenFrame(
        token_id=tt.token_id, text=tt.text, bytes_=tt.bytes_, index=t.index, shape=shape, hidden_state=hidden_of(t),
        context_shift=context_shift_of(t) if t.attention is not None else UNSET,
        positions=True if t.positions is not None else UNSET,
        context_length=t.context_length if reduced else UNSET,
        sink=UNSET if t.sink is None else t.sink,
    )  # fmt: skip


def progress_event(p: ProgressOut, request_id: str | None) -> ProgressEvent:
    """The ``progress`` event of a prefill step."""
    pp = PromptProgress(total=p.total, cache=p.cache, processed=p.processed, time_ms=p.time_ms)
    return ProgressEvent(request_id=request_id, prompt_progress=pp)


def done_event(d: DoneOut, request_id: str | None) -> DoneEvent:
    """The ``done`` event of a finished generation."""
    return DoneEvent(
        request_id=request_id,
        finish_reason=d.finish_reason,
        total_tokens=d.n_generated,
        generation_time_ms=round(d.generation_time_ms, 3),
        prompt_tokens=d.n_prompt,
        cached_tokens=d.n_cached,
        slot_id=slot_id_out(d.slot_id),
        stop_string=d.stop_string or UNSET,
        truncated=d.truncated or UNSET,
    )
