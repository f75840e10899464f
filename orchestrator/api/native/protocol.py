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
from contract.protocol import AttentionDtype, AttentionFormat, SamplingParams
from orchestrator.api.kobold.protocol import KoboldResult
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.request import (
    DEFAULT,
    CanonicalRequest,
    Float32,
    NonNegFloat32,
    NProbs,
    Probability,
    RepeatLastN,
    SamplerFields,
    Seed,
    TokenCount,
    TopK,
)
from orchestrator.slots.model import slot_id_out
from orchestrator.web.errors import ErrorEvent


class GenerateRequest(SamplerFields, kw_only=True):
    """A generation request: the whole context as ``input_ids`` (or a ``prompt`` text)."""

    type: str | None = None
    request_id: str | None = None
    input_ids: list[int] | None = None
    prompt: str | None = None
    max_new_tokens: TokenCount | None = None
    max_length: TokenCount | None = None
    max_tokens: TokenCount | None = None
    n_predict: TokenCount | None = None
    temperature: Float32 | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: NonNegFloat32 | None = None
    rep_pen: NonNegFloat32 | None = None
    repeat_penalty: NonNegFloat32 | None = None
    rep_pen_range: RepeatLastN | None = None
    repeat_last_n: RepeatLastN | None = None
    seed: Seed | None = None
    sampler_seed: Seed | None = None
    stop_tokens: list[int] | None = None
    banned_tokens: list[int | str] | None = None  # ids, or KoboldCpp's strings (resolved by the handler)
    stop_sequence: list[str] | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    return_attention: bool | None = None
    output_attentions: bool | None = None
    attention_format: AttentionFormat = "per_layer"
    attention_dtype: AttentionDtype = "float32"
    attention_layers: list[int] | None = None
    output_hidden_states: bool = False
    logprobs: bool | None = None
    n_probs: NProbs | None = None
    top_logprobs: NProbs | None = None
    conversation_id: str | int | None = None
    id_slot: str | int | None = None
    wait: bool = False
    # KoboldCpp's fields (koboldcpp.py ``generate``); see orchestrator/api/kobold/routes.py
    genkey: str | None = None
    trim_stop: bool = False
    max_context_length: int | None = None
    memory: str | None = None
    banned_strings: list[str] | None = None
    n: int | None = None
    typical: Probability | None = None  # KoboldCpp's typical_p
    nsigma: Float32 | None = None  # KoboldCpp's top_n_sigma
    return_progress: bool = False  # llama-server's: stream prompt-processing progress events

    def sampler_fields(self) -> dict[str, Any]:
        """:meth:`SamplerFields.sampler_fields`, KoboldCpp's ``typical`` and ``nsigma`` standing in
        for ``typical_p`` and ``top_n_sigma`` when those are missing."""
        out = super().sampler_fields()
        out["typical_p"] = self.typical if self.typical_p is None else self.typical_p
        out["top_n_sigma"] = self.nsigma if self.top_n_sigma is None else self.top_n_sigma
        return out

    def canonical(self, defaults: SamplingParams = DEFAULT) -> CanonicalRequest:
        """Merge aliases (first given wins, slotserve's own names first) into one canonical request;
        a field no alias gives is taken from ``defaults`` (KoboldCpp's routes pass KoboldCpp's)."""

        def first(*vals: Any, default: Any) -> Any:
            return next((v for v in vals if v is not None), default)

        stops: list[str] = []
        for s in (self.stop_sequence, self.stop):
            if isinstance(s, str):
                stops.append(s)
            elif s:
                stops.extend(s)
        slot = first(self.conversation_id, self.id_slot, default=None)
        return CanonicalRequest(
            request_id=self.request_id,
            input_ids=self.input_ids,
            prompt=self.prompt,
            max_new_tokens=int(
                first(
                    self.max_new_tokens,
                    self.max_length,
                    self.max_tokens,
                    self.n_predict,
                    default=defaults.max_new_tokens,
                )
            ),
            temperature=float(first(self.temperature, default=defaults.temperature)),
            top_p=float(first(self.top_p, default=defaults.top_p)),
            top_k=int(first(self.top_k, default=defaults.top_k)),
            min_p=float(first(self.min_p, default=defaults.min_p)),
            repeat_penalty=float(
                first(self.repetition_penalty, self.rep_pen, self.repeat_penalty, default=defaults.repeat_penalty)
            ),
            repeat_last_n=int(first(self.rep_pen_range, self.repeat_last_n, default=defaults.repeat_last_n)),
            seed=int(first(self.seed, self.sampler_seed, default=defaults.seed)),
            stop_tokens=list(self.stop_tokens or []),
            banned_tokens=[t for t in self.banned_tokens or [] if isinstance(t, int)],
            stop_strings=[s for s in stops if s],
            ignore_eos=self.ignore_eos,
            attention=bool(first(self.return_attention, self.output_attentions, default=False)),
            attention_format=self.attention_format,
            attention_dtype=self.attention_dtype,
            attention_layers=self.attention_layers,
            hidden_state=self.output_hidden_states,
            n_probs=int(first(self.top_logprobs, self.n_probs, default=0)),
            slot=None if slot is None else str(slot),  # None: chosen by prompt (orchestrator/slots/anonymous.py)
            wait=self.wait or slot is None,  # a request naming no slot queues, as KoboldCpp does
            progress=self.return_progress,
            **self.sampler_settings(defaults),
        )


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


class TokenText(msgspec.Struct, kw_only=True):
    """A token and its text; ``bytes`` (the raw piece) when the piece alone is not valid UTF-8."""

    token_id: int
    text: str
    bytes_: list[int] | UnsetType = msgspec.field(default=UNSET, name="bytes")


class ContextShift(msgspec.Struct, kw_only=True):
    """A context shift before this token (``--context-shift``; docs/api.md, "Context shift"): the slot's
    tokens ``n_keep .. n_keep+n_discard-1`` were dropped and the later ones moved down, so from this
    token on, attention position ``p >= n_keep`` is the earlier tokens' ``p + n_discard``."""

    n_keep: int
    n_discard: int


class Attention(msgspec.Struct, kw_only=True):
    """One token's attention (docs/api.md, "Attention"): ``shape`` ``[n_layers, n_heads, context_length]``
    (``per_layer``) or ``[context_length]`` (``aggregated``), ``data`` base64 of ``dtype`` values;
    ``context_shift`` on the first row after a context shift."""

    format: str
    shape: list[int]
    context_length: int
    encoding: str
    dtype: str
    data: str
    context_shift: ContextShift | UnsetType = UNSET


def context_shift_of(t: TokenOut) -> ContextShift | UnsetType:
    """The :class:`ContextShift` before ``t``, if one came."""
    return UNSET if t.shift is None else ContextShift(n_keep=t.shift[0], n_discard=t.shift[1])


class TokenAttention(TokenText, kw_only=True):
    """A token with its attention (``attention_data`` entries)."""

    attention: Attention | None


def token_text(t: TokenOut) -> TokenText:
    """:class:`TokenText` of a generated token: ``bytes`` only when its piece alone is not valid UTF-8."""
    try:
        t.piece.decode("utf-8")
    except UnicodeDecodeError:
        return TokenText(token_id=t.token_id, text=t.text, bytes_=list(t.piece))
    return TokenText(token_id=t.token_id, text=t.text)


def attention_of(t: TokenOut, fmt: str, dtype: str) -> Attention | None:
    """The attention object of the JSON and SSE APIs (docs/api.md, "Attention"): ``t.attention``, the
    worker's little-endian ``dtype`` bytes of ``t.attention_shape``, base64-encoded; ``None`` without."""
    if t.attention is None:
        return None
    data = base64.b64encode(t.attention).decode("ascii")
    shape = t.attention_shape
    return Attention(
        format=fmt, shape=shape, context_length=shape[-1], encoding="base64", dtype=dtype, data=data,
        context_shift=context_shift_of(t),
    )  # fmt: skip


def token_attention(t: TokenOut, fmt: str, dtype: str) -> TokenAttention:
    """:class:`TokenAttention` of a generated token (``fmt``/``dtype`` as requested)."""
    tt = token_text(t)
    return TokenAttention(token_id=tt.token_id, text=tt.text, bytes_=tt.bytes_, attention=attention_of(t, fmt, dtype))


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
    truncated: bool | UnsetType = UNSET
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
    (raw float32 of ``shape``; no binary frame when ``shape`` is absent)."""

    token_id: int
    text: str
    bytes_: list[int] | UnsetType = msgspec.field(default=UNSET, name="bytes")
    index: int
    shape: list[int] | UnsetType = UNSET
    hidden_state: Hidden | UnsetType = UNSET
    context_shift: ContextShift | UnsetType = UNSET


class PromptProgress(msgspec.Struct, kw_only=True):
    """llama-server's ``prompt_progress`` (``return_progress``): ``processed`` of ``total`` prompt tokens
    are in the KV cache, ``cache`` of them reused, after ``time_ms`` milliseconds."""

    total: int
    cache: int
    processed: int
    time_ms: float


class ProgressEvent(msgspec.Struct, kw_only=True, tag="progress", tag_field="type"):
    """Prompt-processing progress, before the first token (``return_progress``)."""

    request_id: str | None
    prompt_progress: PromptProgress


class QueuedEvent(msgspec.Struct, kw_only=True, tag="queued", tag_field="type"):
    """On the WebSockets, while a request waits for a free engine sequence: its place (1 = next)."""

    position: int
    request_id: str | None


class DoneEvent(msgspec.Struct, kw_only=True, tag="done", tag_field="type"):
    """The last event of a generation (docs/api.md, "``done`` fields"): token counts, milliseconds."""

    request_id: str | None
    finish_reason: str
    total_tokens: int
    generation_time_ms: float
    prompt_tokens: int
    cached_tokens: int
    slot_id: int | str
    stop_string: str | UnsetType = UNSET
    truncated: bool | UnsetType = UNSET  # the context shifted (or the generation ended at the window)


StreamEvent = TokenEvent | SseTokenEvent | BinaryTokenFrame | ProgressEvent | QueuedEvent | DoneEvent | ErrorEvent
"""Every event slotserve's native streams send (one ``token`` shape per stream)."""


def payload_bytes(t: TokenOut) -> int:
    """The raw bytes a token's event carries base64-encoded (attention and hidden state)."""
    return len(t.attention or b"") + len(t.hidden or b"")


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


def binary_token_frame(t: TokenOut) -> BinaryTokenFrame:
    """The binary WebSocket's text frame of ``t``."""
    tt = token_text(t)
    shape = UNSET if t.attention is None else t.attention_shape
    return BinaryTokenFrame(
        token_id=tt.token_id, text=tt.text, bytes_=tt.bytes_, index=t.index, shape=shape, hidden_state=hidden_of(t),
        context_shift=context_shift_of(t) if t.attention is not None else UNSET,
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
