"""llama-server's API as slotserve serves it: ``/completion``, ``/props`` and the slot API.

Field names and shapes are llama-server's (llama.cpp ``tools/server/README.md``; ``tools/server/server-task.cpp``).
A field typed ``... | UnsetType`` is left out when unset; ``None`` is sent as ``null``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from orchestrator.api.common.completion import SamplerSettings
from orchestrator.api.common.wire import MessageSpan


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
    slotserve conversation beyond llama-server's ``n_parallel`` numbered slots; ``tenant``: its owner."""

    id: int | str
    n_ctx: int
    is_processing: bool
    n_tokens: int
    place: str
    stored_bytes: int | None
    state_bytes: int | None
    tenant: str | UnsetType = UNSET  # the slot's owner (docs/operations.md, "Tenants")
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
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class AppliedTemplate(msgspec.Struct, kw_only=True):
    """``POST /apply-template``: the prompt text the chat template makes of the messages."""

    prompt: str


class InputTokens(msgspec.Struct, kw_only=True):
    """``POST /chat/completions/input_tokens``: how many tokens the messages' prompt is."""

    input_tokens: int
