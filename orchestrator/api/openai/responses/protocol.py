"""OpenAI's Responses API wire types: ``POST /v1/responses``' request, its response object and its
streamed events (OpenAI's API reference, "Responses"; llama-server's ``/v1/responses``)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from orchestrator.api.common.timings import Timings
from orchestrator.api.common.wire import PromptProgress
from orchestrator.api.openai.protocol import ReasoningBudget
from orchestrator.generation.request import (
    Float32,
    Probability,
    Seed,
    TokenCount,
)
from orchestrator.tenants.conversation import CacheSalt, PromptCacheKey


class TextFormat(msgspec.Struct, kw_only=True):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``schema`` (flat, as the
    Responses API writes it)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextOptions(msgspec.Struct, kw_only=True):
    """``text``: the output's ``format``."""

    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses`` (OpenAI's fields this server reads; others are accepted and unused).
    ``slot_id`` (slotserve's extension, as on chat completions) picks the slot of a new conversation."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Float32 | None = None
    top_p: Probability | None = None
    seed: Seed | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    user: str | None = None
    prompt_cache_key: PromptCacheKey | None = None
    cache_salt: CacheSalt | None = None  # vLLM's
    slot_id: str | int | None = None
    background: bool | None = None
    timings_per_token: bool = False  # llama-server's: ``timings`` on the text deltas and the last event
    return_progress: bool = False  # llama-server's: ``prompt_progress`` on ``response.in_progress`` events
    reasoning_format: str | None = None  # llama-server's reasoning fields, as on chat completions
    reasoning_budget_tokens: ReasoningBudget | None = None
    thinking_budget_tokens: ReasoningBudget | None = None
    reasoning_budget_message: str | None = None


class TokenDetails(msgspec.Struct, kw_only=True):
    """``input_tokens_details`` / ``output_tokens_details`` of a response's usage."""

    cached_tokens: int | UnsetType = UNSET
    reasoning_tokens: int | UnsetType = UNSET


class ResponseUsage(msgspec.Struct, kw_only=True):
    """``usage`` of a response (``input_tokens_details.cached_tokens``: prompt tokens from the slot's cache)."""

    input_tokens: int
    input_tokens_details: TokenDetails
    output_tokens: int
    output_tokens_details: TokenDetails
    total_tokens: int


class OutputText(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    """A ``message`` item's text part."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class MessageItem(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    """An output item: the assistant's message (``content``: its text part, once complete)."""

    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    """An output item: one tool call (``arguments``: JSON text)."""

    id: str
    status: str
    call_id: str
    name: str
    arguments: str


class ReasoningText(msgspec.Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    """A ``reasoning`` item's text part."""

    text: str


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """An output item: the model's thinking (llama-server's: ``content`` one ``reasoning_text`` part once
    complete, ``summary`` empty, ``encrypted_content`` "")."""

    id: str
    status: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    encrypted_content: str = ""


OutputItem = ReasoningItem | MessageItem | FunctionCallItem
"""An item of a response's ``output``."""


class ResponseObject(msgspec.Struct, kw_only=True):
    """OpenAI's response object (``output``: ``message`` and ``function_call`` items)."""

    id: str
    object: str
    created_at: int
    status: str
    error: dict[str, Any] | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: str
    metadata: dict[str, str]
    store: bool
    usage: ResponseUsage | None


class ResponseEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    """What every Responses streaming event carries: its place in the stream."""

    sequence_number: int


class ResponseCreated(ResponseEvent, kw_only=True, tag="response.created"):
    """First event: the response as it starts."""

    response: ResponseObject


class ResponseInProgress(ResponseEvent, kw_only=True, tag="response.in_progress"):
    """The response is being generated; with ``return_progress`` (llama-server's), one more per prefill step,
    with its ``prompt_progress``."""

    response: ResponseObject
    prompt_progress: PromptProgress | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET


class ResponseCompleted(ResponseEvent, kw_only=True, tag="response.completed"):
    """Last event: the whole response (``status`` ``incomplete`` when ``max_output_tokens`` ended it);
    ``timings`` (llama-server's, ``timings_per_token``) the generation's."""

    response: ResponseObject
    timings: Timings | UnsetType = UNSET


class OutputItemAdded(ResponseEvent, kw_only=True, tag="response.output_item.added"):
    """An output item starts."""

    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, kw_only=True, tag="response.output_item.done"):
    """An output item is complete."""

    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, kw_only=True, tag="response.content_part.added"):
    """A message's text part starts (empty)."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(ResponseEvent, kw_only=True, tag="response.content_part.done"):
    """A message's text part is complete."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(ResponseEvent, kw_only=True, tag="response.output_text.delta"):
    """More text of a message."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    timings: Timings | UnsetType = UNSET  # timings_per_token (llama-server's): the timings so far


class OutputTextDone(ResponseEvent, kw_only=True, tag="response.output_text.done"):
    """A message's whole text."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDelta(ResponseEvent, kw_only=True, tag="response.reasoning_text.delta"):
    """More of the thinking of the ``reasoning`` item ``item_id``."""

    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(ResponseEvent, kw_only=True, tag="response.reasoning_text.done"):
    """The ``reasoning`` item's whole text."""

    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(ResponseEvent, kw_only=True, tag="response.function_call_arguments.delta"):
    """More of a tool call's arguments (a whole call's arguments at once here)."""

    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(ResponseEvent, kw_only=True, tag="response.function_call_arguments.done"):
    """A tool call's whole arguments."""

    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseError(ResponseEvent, kw_only=True, tag="error"):
    """The engine failed mid-way: the stream ends after this."""

    code: str
    message: str
    param: str | None = None


ResponseStreamEvent = (
    ResponseCreated
    | ResponseInProgress
    | OutputItemAdded
    | ContentPartAdded
    | ReasoningTextDelta
    | ReasoningTextDone
    | OutputTextDelta
    | OutputTextDone
    | ContentPartDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | OutputItemDone
    | ResponseCompleted
    | ResponseError
)
"""Every event of a streamed response, in the order a client meets them."""
