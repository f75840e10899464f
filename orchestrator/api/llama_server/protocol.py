"""llama-server's API as slotserve serves it: ``/completion``, ``/props`` and the slot API.

Field names and shapes are llama-server's (llama.cpp ``tools/server/README.md``; ``tools/server/server-task.cpp``).
A field typed ``... | UnsetType`` is left out when unset; ``None`` is sent as ``null``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from orchestrator.api.native.protocol import MessageSpan, PromptProgress
from orchestrator.generation.request import (
    INT32_MAX,
    Float32,
    NonNegFloat32,
    NProbs,
    Probability,
    RepeatLastN,
    SamplerFields,
    Seed,
    TopK,
)


class ContextShiftRequest(msgspec.Struct, kw_only=True):
    """``POST /slots/{id}?action=context-shift`` (llama-server's ``n_keep``/``n_discard``)."""

    n_keep: int
    n_discard: int


class SlotFileRequest(msgspec.Struct, kw_only=True):
    """``POST /slots/{id}?action=save|restore`` (llama-server's file actions)."""

    filename: str


class ForkRequest(msgspec.Struct, kw_only=True):
    """``POST /slots/{id}?action=fork``: the new slot's id."""

    target: str | int


class RestoreStateRequest(msgspec.Struct, kw_only=True):
    """``POST /slots/{id}?action=restore-state`` with JSON: base64 SES1 blob.

    ``digest`` (optional): the decoded blob's RFC 9530 digest, e.g. ``"sha-256=:<base64>:"``
    as ``save-state`` returned it; a state that does not match is refused (``BAD_STATE``).
    """

    state: str
    digest: str | None = None


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


class TokenProb(msgspec.Struct, kw_only=True):
    """One of a token's ``top_logprobs`` (the model's log-probability), or with ``post_sampling_probs`` one of
    its ``top_probs`` (the probability after the sampler chain, 0 < ``prob`` <= 1)."""

    id: int
    token: str
    bytes_: list[int] = msgspec.field(name="bytes")
    logprob: float | UnsetType = UNSET
    prob: float | UnsetType = UNSET


class CompletionProb(msgspec.Struct, kw_only=True):
    """llama-server's ``completion_probabilities[]`` entry (``n_probs``; ``tools/server/server-task.cpp``
    ``completion_token_output::probs_vector_to_json``): ``logprob`` and ``top_logprobs`` (the model's
    distribution), or with ``post_sampling_probs`` ``prob`` and ``top_probs`` (after the sampler chain, at
    most ``n_probs``, none at 0: fewer when fewer tokens are left)."""

    id: int
    token: str
    bytes_: list[int] = msgspec.field(name="bytes")
    logprob: float | UnsetType | None = UNSET
    top_logprobs: list[TokenProb] | UnsetType = UNSET
    prob: float | UnsetType = UNSET
    top_probs: list[TokenProb] | UnsetType = UNSET


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
    post_sampling_probs: bool
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
    reasoning_content: str | UnsetType = UNSET  # with reasoning_format (slotserve's): the thought, out of content


class LlamaCompletionChunk(msgspec.Struct, kw_only=True):
    """A streamed ``/completion`` chunk (``stream: true``; ``data: {json}`` events): generated text so far
    not yet sent, with ``stop: false``; the last event is a :class:`LlamaCompletion` (``stop: true``)."""

    index: int
    content: str
    tokens: list[int]
    stop: bool = False
    id_slot: int | str
    tokens_predicted: int
    tokens_evaluated: int
    completion_probabilities: list[CompletionProb] | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET  # timings_per_token: the timings so far
    prompt_progress: PromptProgress | UnsetType = UNSET  # return_progress: a prefill step (no text)
    reasoning_content: str | UnsetType = UNSET  # with reasoning_format: the thought's new text


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


JSON_PROMPT_STRING_KEY = "prompt_string"


class PromptObject(msgspec.Struct, kw_only=True):
    """``{"prompt_string": ..., "multimodal_data": [base64, ...]}`` (multimodal data is refused)."""

    prompt_string: str | list[int | str]
    multimodal_data: list[str] | None = None


SubPrompt = str | list[int | str] | PromptObject
Prompt = str | list[int | str | list[int | str] | PromptObject] | PromptObject
"""The ``prompt`` field's type (see the module docstring)."""


NPredict = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX, description="-1: to the end of the window")]


class CompletionBody(SamplerFields, kw_only=True):
    """``POST /completion`` (llama-server README, "POST /completion": options; the further samplers,
    ``grammar`` and ``json_schema`` in :class:`orchestrator.generation.request.SamplerFields`)."""

    prompt: Prompt
    n_predict: NPredict | None = None  # None: the server's --n-predict
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int | str = -1
    n_probs: NProbs = 0
    temperature: Float32 | None = None
    top_k: TopK | None = None
    top_p: Probability | None = None
    min_p: Probability | None = None
    repeat_penalty: NonNegFloat32 | None = None
    repeat_last_n: RepeatLastN | None = None
    seed: Seed | None = None
    stop: list[str] | None = None
    ignore_eos: bool = False
    return_tokens: bool = False
    post_sampling_probs: bool = False
    response_fields: list[str] | None = None
    timings_per_token: bool = False
    return_progress: bool = False
    # llama-server's thinking budget (its README): tokens (-1 or None: --reasoning-budget), the tags (None: the
    # chat template's) and the message forced before the end tag; reasoning_format (slotserve's: None or
    # "none" leaves thoughts in content, as llama-server's /completion) splits them into reasoning_content
    reasoning_budget_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    reasoning_budget_start_tag: str | None = None
    reasoning_budget_end_tag: str | None = None
    reasoning_budget_message: str | None = None
    reasoning_format: str | None = None


class SlotAction(StrEnum):
    """The ``action`` of ``POST /slots/{id}`` (llama-server's, plus ``fork``)."""

    SAVE_STATE = "save-state"
    RESTORE_STATE = "restore-state"
    TOKENS = "tokens"
    CONTEXT_SHIFT = "context-shift"
    SAVE = "save"
    RESTORE = "restore"
    ERASE = "erase"
    FORK = "fork"


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


# ---------------------------------------------------------------------------------- chat templates


class ChatPromptBody(msgspec.Struct, kw_only=True):
    """The part of a chat completion body that makes its prompt (other fields are ignored here)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class AppliedTemplate(msgspec.Struct, kw_only=True):
    """``POST /apply-template``: the prompt text the chat template makes of the messages."""

    prompt: str


class InputTokens(msgspec.Struct, kw_only=True):
    """``POST /chat/completions/input_tokens``: how many tokens the messages' prompt is."""

    input_tokens: int
