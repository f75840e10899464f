"""A streamed answer as its client may see it: the one splitter every chat surface streams through.

Generated text goes through, in order: the stop strings (held back and cut by
:class:`orchestrator.generation.stop_text.StopTextFilter`, as llama-server never sends them), the
reasoning parser (:class:`orchestrator.generation.parsers.reasoning.ReasoningParser`: thoughts out as
:class:`~orchestrator.generation.pieces.ReasoningDelta`), then the tool plan's parser (one per format,
:mod:`orchestrator.generation.parsers`: content text and
:class:`~orchestrator.generation.pieces.CallDelta` pieces).  A whole answer is read by the same code
(:meth:`AnswerText.whole`), so streamed and whole answers agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.generation.parsers.base import ToolParser
from orchestrator.generation.parsers.reasoning import ReasoningParser
from orchestrator.generation.pieces import Piece, ReasoningDelta
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.generation.tool_calls import ToolCall


@dataclass
class WholeAnswer:
    """A whole answer read: ``content`` (None when it only called tools), ``reasoning`` ("" when none)
    and the tool ``calls``."""

    content: str | None
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class AnswerText:
    """Reads one answer (module docstring).  ``stops``: the stop strings; ``tools``: the tool plan's
    parser for this answer (None: no tool calls read); ``reasoning``: the reasoning parser (None: thoughts
    stay in the content, ``reasoning_format: none`` or a template without thinking tags)."""

    def __init__(self, stops: list[str], tools: ToolParser | None, reasoning: ReasoningParser | None = None) -> None:
        self.stops = StopTextFilter(stops)
        self.split = tools
        self.reasoning = reasoning

    @property
    def calls(self) -> list[ToolCall]:
        """The tool calls given out so far (their arguments as far as they went)."""
        return self.split.calls if self.split is not None else []

    def _tools(self, pieces: list[Piece], final: bool) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, str) and self.split is not None:
                out += self.split.feed(piece)
            elif piece:
                out.append(piece)
        if final and self.split is not None:
            out += self.split.finish()
        return out

    def _pieces(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        if self.reasoning is not None:
            pieces = self.reasoning.feed(text) + (self.reasoning.finish() if final else [])
        elif text:
            pieces = [text]
        return self._tools(pieces, final)

    def feed(self, text: str) -> list[Piece]:
        """The pieces that can be sent now, of ``text`` and what was held."""
        return self._pieces(self.stops.feed(text), final=False)

    def finish(self, stop_string: str = "") -> list[Piece]:
        """The pieces left at the end: what was held (cut before ``stop_string``, the stop string that ended
        the generation, if any), a held call completed or given out as content."""
        return self._pieces(self.stops.finish(stop_string), final=True)

    def whole(self, texts: list[str], stop_string: str = "") -> WholeAnswer:
        """A whole answer, its tokens' ``texts`` fed in one piece: with calls, ``content`` is the text around
        them stripped (None when empty); without, the text as it was."""
        pieces = self.feed("".join(texts)) + self.finish(stop_string)
        content = "".join(p for p in pieces if isinstance(p, str))
        reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
        if self.calls:
            return WholeAnswer(content.strip() or None, reasoning, self.calls)
        return WholeAnswer(content, reasoning)
