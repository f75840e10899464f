"""The Anthropic Messages API's request bodies, response bodies and stream events.

Shapes are Anthropic's (API reference: "Messages", "Count tokens", "Streaming messages") as
llama-server serves them (llama.cpp ``tools/server/server-chat.cpp``
``server_chat_convert_anthropic_to_oai`` reads the request; ``server-task.cpp``
``to_json_anthropic*`` writes the answer and the stream).  Content blocks, the message and every
stream event are tagged by their ``type``; a field typed ``... | UnsetType`` is left out when unset.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from orchestrator.generation.request import Float32, Probability, TokenCount, TopK
from orchestrator.tenants.conversation import CacheSalt
from orchestrator.web.errors import CompatErrorBody

# ------------------------------------------------------------------------------------ content blocks


class TextBlock(msgspec.Struct, kw_only=True, tag="text", tag_field="type"):
    """A text block (in a message, ``system``, a tool result, or the answer)."""

    text: str


class ImageSource(msgspec.Struct, kw_only=True):
    """An image block's ``source``: ``base64`` with ``media_type`` and ``data``, or ``url``."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(msgspec.Struct, kw_only=True, tag="image", tag_field="type"):
    """An image block (accepted, then refused: this server reads text only)."""

    source: ImageSource


class ToolUseBlock(msgspec.Struct, kw_only=True, tag="tool_use", tag_field="type"):
    """A tool call: in an assistant message of the history, or in the answer (``input``: the
    arguments, a JSON object)."""

    id: str
    name: str
    input: dict[str, Any] = {}


class ToolResultBlock(msgspec.Struct, kw_only=True, tag="tool_result", tag_field="type"):
    """A tool's result, in a user message: ``content`` text or text (and image) blocks; ``is_error``
    is accepted and not shown to the model, as llama-server."""

    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, kw_only=True, tag="thinking", tag_field="type"):
    """An assistant's reasoning: in the history (given to the template as ``reasoning_content``), or the
    answer's thinking (first block, ``signature`` "": a local model signs nothing, as llama-server)."""

    thinking: str
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, kw_only=True, tag="redacted_thinking", tag_field="type"):
    """Encrypted reasoning from Anthropic's models in the history: accepted and left out of the prompt."""

    data: str = ""


InputBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
"""A block of a request message's ``content``."""

AnswerBlock = ThinkingBlock | TextBlock | ToolUseBlock
"""A block of the answer's ``content``."""


# ------------------------------------------------------------------------------------------ request


class InputMessage(msgspec.Struct, kw_only=True):
    """One turn: ``content`` a text or blocks."""

    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class ToolDef(msgspec.Struct, kw_only=True):
    """A client tool: ``input_schema`` is its arguments' JSON schema (``type`` absent or ``custom``;
    Anthropic's server tools are refused)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = {}
    type: str | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice``: ``auto``, ``any`` (some tool must be called), ``tool`` (``name`` must be
    called) or ``none``; ``disable_parallel_tool_use`` is accepted (one call per answer, as llama-server)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingOption(msgspec.Struct, kw_only=True):
    """``thinking`` (extended thinking): ``{"type": "enabled", "budget_tokens"}`` is the thinking budget
    (llama-server's ``thinking_budget_tokens``, 10000 when left out); other types leave the server's."""

    type: str
    budget_tokens: TokenCount | None = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's fields this server reads;
    others are accepted and unused).  ``max_tokens`` is optional (default 4096, bounded by the
    context window: llama-server's permissive default); ``slot_id`` is slotserve's extension (as on
    chat completions; also the ``X-Slot-Id`` header)."""

    model: str | None = None
    messages: list[InputMessage]
    max_tokens: TokenCount | None = None
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: Float32 | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    stream: bool = False
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: ThinkingOption | None = None
    slot_id: str | int | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: caches are shared only between equal salts


# ----------------------------------------------------------------------------------------- response


class MessageUsage(msgspec.Struct, kw_only=True):
    """Token counts, as llama-server writes them: ``input_tokens`` the prompt tokens decoded for this
    request, ``cache_read_input_tokens`` those reused from the slot's KV cache (their sum is the
    prompt), ``output_tokens`` the generated ones."""

    cache_read_input_tokens: int
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    """The answer: ``content`` its text block and tool calls; ``stop_reason`` null only in
    ``message_start``; ``slot_id`` (slotserve's extension, not in ``message_start``) the slot it ran on."""

    id: str
    role: str = "assistant"
    content: list[AnswerBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    slot_id: int | str | UnsetType = UNSET


class MessageTokens(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt's size in tokens."""

    input_tokens: int


class MessageError(CompatErrorBody, kw_only=True, omit_defaults=True, tag="error", tag_field="type"):
    """An error: llama-server's body (``error``: ``code``, ``message``, ``type``; slotserve's
    ``error_code``) under Anthropic's ``"type": "error"``; also the stream's ``error`` event."""


# ------------------------------------------------------------------------------------ stream events
# Sent as ``event: <type>`` + ``data: {json}`` (orchestrator.web.sse.named_event), in this order:
# message_start, then per block content_block_start, content_block_delta..., content_block_stop,
# then message_delta and message_stop.


class MessageStart(msgspec.Struct, kw_only=True, tag="message_start", tag_field="type"):
    """First event, with the first generated token: the message, ``content`` empty, ``output_tokens`` 0."""

    message: Message


class ContentBlockStart(msgspec.Struct, kw_only=True, tag="content_block_start", tag_field="type"):
    """A block begins at ``index`` (thinking: empty ``thinking``; text: empty ``text``; a tool call: ``id``,
    ``name``, empty ``input``)."""

    index: int
    content_block: AnswerBlock


class TextDelta(msgspec.Struct, kw_only=True, tag="text_delta", tag_field="type"):
    """More text of a text block."""

    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag="thinking_delta", tag_field="type"):
    """More of a thinking block's text."""

    thinking: str


class SignatureDelta(msgspec.Struct, kw_only=True, tag="signature_delta", tag_field="type"):
    """A thinking block's signature, sent before the block stops ("" here, as llama-server)."""

    signature: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag="input_json_delta", tag_field="type"):
    """More of a tool call's ``input`` as JSON text (the pieces joined are the whole object)."""

    partial_json: str


class ContentBlockDelta(msgspec.Struct, kw_only=True, tag="content_block_delta", tag_field="type"):
    """A piece of block ``index``."""

    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, kw_only=True, tag="content_block_stop", tag_field="type"):
    """Block ``index`` is complete."""

    index: int


class MessageEnd(msgspec.Struct, kw_only=True):
    """``message_delta``'s ``delta``: why the answer ended."""

    stop_reason: StopReason
    stop_sequence: str | None


class OutputUsage(msgspec.Struct, kw_only=True):
    """``message_delta``'s ``usage``: the tokens generated."""

    output_tokens: int


class MessageDelta(msgspec.Struct, kw_only=True, tag="message_delta", tag_field="type"):
    """The end of the answer: stop reason and output tokens."""

    delta: MessageEnd
    usage: OutputUsage


class MessageStop(msgspec.Struct, kw_only=True, tag="message_stop", tag_field="type"):
    """Last event."""


MessageStreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | MessageError
)
"""Every event of a ``/v1/messages`` stream."""
