"""docs/stream-events.md, generated from the stream events' Structs: ``python -m orchestrator.api.stream_docs``.

Every event a stream sends is a msgspec Struct in its surface's ``protocol.py``; this page lists, per
stream, each event's fields and their JSON types as msgspec's JSON Schema gives them
(``msgspec.json.schema_components``), so the page cannot drift from what is encoded
(``tests/test_docs.py`` compares it with the file).
"""

from __future__ import annotations

import sys
from typing import Any, get_args

import msgspec

from orchestrator.admin.protocol import AttentionEvent, SlotsEvent
from orchestrator.api.anthropic.protocol import MessageStreamEvent
from orchestrator.api.common.completion import LlamaCompletion, LlamaCompletionChunk
from orchestrator.api.common.kobold import KoboldTokenEvent
from orchestrator.api.native.protocol import (
    BinaryTokenFrame,
    DoneEvent,
    ProgressEvent,
    QueuedEvent,
    SseTokenEvent,
    TokenEvent,
)
from orchestrator.api.openai.protocol import ChatCompletionChunk, TextCompletionChunk
from orchestrator.api.openai.responses.protocol import ResponseStreamEvent
from orchestrator.web.errors import ErrorEvent

STREAMS: list[tuple[str, list[type[msgspec.Struct]]]] = [
    ("POST /api/extra/generate/stream (KoboldCpp's events)", [KoboldTokenEvent, ErrorEvent]),
    ("POST /api/extra/generate/stream with attention", [ProgressEvent, SseTokenEvent, DoneEvent, ErrorEvent]),
    ("WS /api/v1/generate/stream", [QueuedEvent, ProgressEvent, TokenEvent, DoneEvent, ErrorEvent]),
    (
        "WS /api/extra/generate/stream/ws (text frames)",
        [QueuedEvent, ProgressEvent, BinaryTokenFrame, DoneEvent, ErrorEvent],
    ),
    ("GET /admin/events", [SlotsEvent, AttentionEvent, ErrorEvent]),
    ("POST /v1/chat/completions with stream (then data: [DONE])", [ChatCompletionChunk]),
    ("POST /v1/completions with stream (then data: [DONE])", [TextCompletionChunk]),
    ("POST /completion with stream (llama-server's)", [LlamaCompletionChunk, LlamaCompletion]),
    ("POST /v1/responses with stream (OpenAI's Responses events)", list(get_args(ResponseStreamEvent))),
    ("POST /v1/messages with stream (Anthropic's Messages events)", list(get_args(MessageStreamEvent))),
]
"""Each stream and the events it sends, in the order a client meets them."""


def _type(schema: dict[str, Any]) -> str:
    """A field's JSON type, short: ``integer``, ``string or null``, ``array of TopLogprob``..."""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " or ".join(_type(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " or ".join(f"`{v}`" for v in schema["enum"])
    if schema.get("type") == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if schema.get("type") == "object" and "additionalProperties" in schema:
        return f"object of {_type(schema['additionalProperties'])}"
    return str(schema.get("type", "any"))


def render() -> str:
    """The page's markdown."""
    types = sorted({t for _, ts in STREAMS for t in ts}, key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(types, ref_template="#/{name}")
    out = [
        "# Stream events",
        "",
        "Generated from the msgspec Structs that encode them (`python -m orchestrator.api.stream_docs >",
        "docs/stream-events.md`; `tests/test_docs.py` checks it is current). Field semantics: [api.md](api.md).",
        "",
    ]
    for title, events in STREAMS:
        out.append(f"- **{title}**: " + ", ".join(f"[{e.__name__}](#{e.__name__.lower()})" for e in events))
    for name in sorted(components):
        comp = components[name]
        out += ["", f"## {name}", "", " ".join(str(comp.get("description", "")).split()), ""]
        props = comp.get("properties")
        if not props:
            continue
        required = set(comp.get("required", []))
        out += ["| field | type | |", "|---|---|---|"]
        for field, schema in props.items():
            out.append(f"| `{field}` | {_type(schema)} | {'always' if field in required else 'when set'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
