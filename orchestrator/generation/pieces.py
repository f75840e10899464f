"""What an answer's parsers give out while it streams: content text, reasoning text, tool-call pieces.

The shapes follow llama-server's ``common_chat_msg_diff`` (``common/chat.h`` of the pinned llama.cpp):
a streamed message is a series of ``content_delta``, ``reasoning_content_delta`` and
``tool_call_delta`` pieces, turned into each API's deltas by the surfaces.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CallDelta:
    """A piece of a streamed tool call, as llama-server's ``common_chat_msg_diff::tool_call_delta``
    (``common/chat.h``): call ``index``'s first delta has its ``id`` and ``name`` (and ``arguments``
    ""), the next ones pieces of ``arguments`` whose concatenation is the call's arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ReasoningDelta:
    """A piece of the model's reasoning (the text between a thinking template's tags, the tags left out),
    as llama-server's ``reasoning_content_delta``; the pieces concatenate to ``reasoning_content``."""

    text: str


Piece = str | CallDelta | ReasoningDelta
"""What the answer's parsers give out: content text (``str``), a :class:`CallDelta` or a
:class:`ReasoningDelta`."""
