"""The reasoning parser: a thinking model's thoughts out of its answer, as llama-server's
``reasoning_format`` does (``deepseek`` / ``auto``: the text between the template's thinking tags goes to
``reasoning_content``, the rest to ``content``; ``none``: no parser, everything is content; llama-server's
README, "--reasoning-format", and ``common/chat.cpp`` of the pinned llama.cpp).

The tags are found in the template's source (:func:`thinking_tags`), as llama.cpp's auto-parser finds
them (``thinking_start_tag`` / ``thinking_end_tags``); thoughts are read only at the start of the answer
(after spaces), or from the first token when the prompt already opened them (a template whose
generation prompt ends with the start tag, llama.cpp's ``thinking_forced_open``).  Same interface as the
tool parsers (:class:`orchestrator.generation.parsers.base.OutputParser`): streamed and whole.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from contract.errors import ErrorCode
from orchestrator.config import ReasoningFormat
from orchestrator.generation.parsers.base import OutputParser
from orchestrator.generation.pieces import Piece, ReasoningDelta
from orchestrator.generation.request import CanonicalRequest
from orchestrator.service_error import ServiceError

REASONING_FORMATS: tuple[str, ...] = typing.get_args(ReasoningFormat)
"""``reasoning_format`` values (:data:`orchestrator.config.ReasoningFormat`)."""


@dataclass(frozen=True)
class ThinkingTags:
    """A template's thinking tags: ``start`` (e.g. ``<think>``) and ``end`` (``</think>``)."""

    start: str
    end: str


KNOWN_TAGS = (
    ThinkingTags("<think>", "</think>"),  # DeepSeek R1, Qwen3, QwQ, SmolLM3, GLM...
    ThinkingTags("<seed:think>", "</seed:think>"),  # Seed-OSS
    ThinkingTags("[THINK]", "[/THINK]"),  # Magistral
    ThinkingTags("<|START_THINKING|>", "<|END_THINKING|>"),  # Command R7B
)


def thinking_tags(template: str) -> ThinkingTags | None:
    """The thinking tags chat template source ``template`` writes (its end tag appears in it), or None."""
    return next((t for t in KNOWN_TAGS if t.end in template), None)


def reasoning_format_of(value: str | None, default: str) -> str:
    """A request's ``reasoning_format`` (None: the server's ``default``); ``INVALID_REQUEST`` for an unknown
    value (llama-server's message)."""
    fmt = default if value is None else value
    if fmt not in REASONING_FORMATS:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"Unknown reasoning format: {fmt}")
    return fmt


def opened_by(prompt: str, tags: ThinkingTags) -> bool:
    """Whether the rendered ``prompt`` ends inside a thought (its generation prompt opened the start tag)."""
    text = prompt.rstrip()
    return text.endswith(tags.start)


def _held(buf: str, tag: str) -> int:
    """How many characters at the end of ``buf`` may be the start of ``tag`` (held until the next piece)."""
    most = min(len(tag) - 1, len(buf))
    return next((k for k in range(most, 0, -1) if tag.startswith(buf[-k:])), 0)


class ReasoningParser(OutputParser):
    """Splits an answer into :class:`ReasoningDelta` pieces (the thought, tags left out, spaces around it
    trimmed) and content text (spaces after the end tag trimmed).  ``opened``: the prompt opened the
    thought, so the answer starts inside it.  A thought the answer ends in (``max_tokens``) is reasoning."""

    def __init__(self, tags: ThinkingTags, opened: bool = False) -> None:
        self.tags = tags
        self.state = "think" if opened else "start"
        self.buf = ""
        self.began = False  # the thought's first non-space was given out

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` makes certain."""
        self.buf += text
        out: list[Piece] = []
        while True:
            before = (self.state, len(self.buf))
            out += getattr(self, "_" + self.state)()
            if (self.state, len(self.buf)) == before:
                return [p for p in out if p and (not isinstance(p, ReasoningDelta) or p.text)]

    def finish(self) -> list[Piece]:
        """What was held: content, or the rest of a thought cut short."""
        rest, self.buf = self.buf, ""
        if self.state == "think":
            rest = rest.rstrip() if self.began else rest.strip()
            return [ReasoningDelta(rest)] if rest else []
        if self.state == "after":
            rest = rest.lstrip()
        return [rest] if rest else []

    def _start(self) -> list[Piece]:
        lead = self.buf.lstrip()
        if lead.startswith(self.tags.start):
            self.buf, self.state = lead[len(self.tags.start) :], "think"
        elif lead and not self.tags.start.startswith(lead):
            self.state = "content"
        return []

    def _think(self) -> list[Piece]:
        if not self.began:
            self.buf = self.buf.lstrip()
        at = self.buf.find(self.tags.end)
        if at >= 0:
            thought = self.buf[:at].rstrip()
            self.buf, self.state = self.buf[at + len(self.tags.end) :], "after"
            return [ReasoningDelta(thought)]
        keep = _held(self.buf, self.tags.end)
        send = self.buf[: len(self.buf) - keep]
        send = send.rstrip()  # spaces before the end tag are not part of the thought
        self.buf = self.buf[len(send) :]
        self.began = self.began or bool(send)
        return [ReasoningDelta(send)]

    def _after(self) -> list[Piece]:
        self.buf = self.buf.lstrip()
        if self.buf:
            self.state = "content"
        return []

    def _content(self) -> list[Piece]:
        out, self.buf = self.buf, ""
        return [out]


@dataclass(frozen=True)
class ReasoningPlan:
    """The reasoning handling of one chat request: the template's ``tags``, whether the prompt ``opened``
    a thought, whether thoughts are split out (``split``: ``reasoning_format`` not ``none``), and the
    thinking ``budget`` (tokens, -1: none) with the ``message`` forced before the end tag when it is spent."""

    tags: ThinkingTags
    opened: bool
    split: bool
    budget: int = -1
    message: str = ""

    def parser(self) -> ReasoningParser | None:
        """A parser for one answer (None: thoughts stay in the content)."""
        return ReasoningParser(self.tags, self.opened) if self.split else None

    def constrain(self, req: CanonicalRequest) -> None:
        """Set the thinking budget on ``req`` (the worker forces the end, :mod:`engine.reasoning_budget`)."""
        if self.budget < 0:
            return
        req.reasoning_budget, req.reasoning_message, req.reasoning_open = self.budget, self.message, self.opened
        req.reasoning_start, req.reasoning_end = self.tags.start, self.tags.end


def reasoning_plan(template: str, prompt: str, fmt: str, budget: int, message: str) -> ReasoningPlan | None:
    """The :class:`ReasoningPlan` of a chat request whose template source is ``template`` and rendered
    prompt ``prompt`` (None when the template has no thinking tags); ``fmt``: a checked
    ``reasoning_format`` (:func:`reasoning_format_of`)."""
    tags = thinking_tags(template)
    if tags is None:
        return None
    return ReasoningPlan(tags, opened_by(prompt, tags), fmt != "none", budget, message)
