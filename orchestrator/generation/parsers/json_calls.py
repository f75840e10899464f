"""The streaming reader shared by the formats whose calls are JSON objects (llama.cpp's partial
parsing: ``common_chat_parse`` with ``is_partial`` and ``common_chat_msg_diff::compute_diffs``,
``common/chat.cpp``; the diffs become ``delta.tool_calls`` in ``tools/server/server-task.cpp``).

A format's module subclasses :class:`JsonCallParser` and sets its hooks: :attr:`~JsonCallParser.marker`
(the text that opens its calls), :attr:`~JsonCallParser.close_tag` (dropped after a call),
:attr:`~JsonCallParser.first_mode` (how an answer starts: ``text``, ``json`` for an answer that is
all JSON, or a ``_<mode>`` method of its own), :attr:`~JsonCallParser.response_key` (a key whose
string value is content) and :meth:`~JsonCallParser.is_call`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from orchestrator.generation.json_scan import JsonScan, Span
from orchestrator.generation.parsers.base import ToolParser
from orchestrator.generation.pieces import CallDelta, Piece
from orchestrator.generation.tool_calls import Tool, ToolCall, call_id

_ARGS_KEYS = ("arguments", "parameters")


@dataclass
class _Open:
    """A call object being read: its name, id, and its arguments' value (a span of the scan)."""

    span: Span
    name: str | None = None
    id: str | None = None
    args: Span | None = None
    args_text: str = ""  # the arguments as known so far (raw JSON, or a string argument decoded)
    raw_sent: int = 0  # a string argument: the raw index decoded up to
    index: int | None = None  # the call's index once its header went out


class JsonCallParser(ToolParser):
    """Reads an answer as it streams and gives out content and tool-call pieces as soon as they are
    certain (module docstring).

    Text before the :attr:`marker` is content, less a tail that could be the marker's start (held until
    the next piece says); after the marker the calls' JSON is scanned (:class:`JsonScan`): a call's
    ``{index, id, name}`` goes out once its name is read and its arguments have begun, then its
    arguments' JSON text piece by piece, exactly as the model wrote it (a string argument: its decoded
    text), so the pieces concatenate to the call's final ``arguments``.  The :attr:`close_tag` and the
    spaces between calls are dropped; other text between or after calls is content.

    Text that was held as a possible call but is not JSON, or a call cut short before its arguments
    began, is given out as content; a call cut short (``max_tokens``) after that stays, with the
    arguments it has (as OpenAI's own cut calls do).  :attr:`calls` holds the calls given out so far.
    """

    marker: ClassVar[str] = ""
    close_tag: ClassVar[str] = ""
    first_mode: ClassVar[str] = "text"
    response_key: ClassVar[str | None] = None

    def __init__(self, tools: list[Tool], parallel: bool) -> None:
        super().__init__(tools, parallel)
        self.mode = self.first_mode
        self.buf = ""  # text read but not yet given out nor consumed
        self.prefix = ""  # text consumed before the scan (a marker), content again if the scan is no call
        self.scan = JsonScan()
        self.open: _Open | None = None
        self.response: Span | None = None  # generic: the "response" string being streamed
        self.response_sent = 0
        self.emitted = False  # whether the current scan gave out anything
        self.out: list[Piece] = []

    # ------------------------------------------------------------------ giving out

    def _content(self, text: str) -> None:
        if text:
            if self.out and isinstance(self.out[-1], str):
                self.out[-1] += text
            else:
                self.out.append(text)

    def _args(self, call: _Open, text: str) -> None:
        assert call.index is not None
        if not text:
            return
        self.calls[call.index].arguments += text
        last = self.out[-1] if self.out else None
        if isinstance(last, CallDelta) and last.index == call.index and last.name is None:
            last.arguments += text
        else:
            self.out.append(CallDelta(call.index, text))

    def _header(self, call: _Open) -> None:
        if call.index is not None or call.name is None:
            return
        call.index = len(self.calls)
        made = ToolCall(call.name, "", call.id or call_id())
        self.calls.append(made)
        self.out.append(CallDelta(call.index, "", made.id, made.name))
        self.emitted = True

    def _take(self) -> list[Piece]:
        out, self.out = self.out, []
        return out

    # ------------------------------------------------------------------ reading

    def feed(self, text: str) -> list[Piece]:
        """The pieces that ``text`` (after what was read before) makes certain, in order."""
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Piece]:
        """The pieces left at the end of the answer (held text, a call cut short)."""
        self._run(final=True)
        if self.mode == "json":
            self._events(self.scan.close())
            if self.scan.done:
                self._scan_done()
            else:
                self._give_up(final=True)
        elif self.mode in ("start", "plain", "text") and (self.buf.strip() or not self.calls):
            self._content(self.buf)  # held text; spaces held after a call are dropped
        self.buf = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while True:
            before = (self.mode, len(self.buf))
            getattr(self, "_" + self.mode)(final)
            if (self.mode, len(self.buf)) == before:
                return

    def _plain(self, final: bool) -> None:
        self._content(self.buf)
        self.buf = ""

    def _text(self, final: bool) -> None:
        if not self.marker:
            self.mode = "plain"
            return
        at = self.buf.find(self.marker)
        if at >= 0:
            self._content(self.buf[:at] if self.buf[:at].strip() or not self.calls else "")
            self._start_scan(self.marker, self.buf[at + len(self.marker) :])
            return
        most = min(len(self.marker) - 1, len(self.buf))
        keep = next((k for k in range(most, 0, -1) if self.marker.startswith(self.buf[-k:])), 0)
        send = self.buf[: len(self.buf) - keep]
        if self.calls and not send.strip():  # spaces after a call: held (dropped if nothing follows)
            return
        self._content(send)
        self.buf = self.buf[len(send) :]

    def _close(self, final: bool) -> None:
        """After a call, its :attr:`close_tag` (and spaces) are dropped."""
        lead = self.buf.lstrip()
        if lead.startswith(self.close_tag):
            self.buf = lead[len(self.close_tag) :]
            self.mode = "text"
        elif not self.close_tag.startswith(lead):
            self.mode = "text"

    def _start_scan(self, prefix: str, rest: str) -> None:
        self.prefix, self.buf = prefix, rest
        self.scan, self.open, self.response, self.emitted = JsonScan(), None, None, False
        self.mode = "json"

    def _json(self, final: bool) -> None:
        self._events(self.scan.feed(self.buf))
        self.buf = ""
        if self.scan.failed:
            self._give_up(final)
        elif self.scan.done:
            self._scan_done()
        else:
            self._progress()

    def _scan_done(self) -> None:
        rest = self.scan.text[self.scan.end :]
        if not self.emitted:  # JSON, but no call: content
            self._content(self.prefix + self.scan.text[: self.scan.end])
        self.buf = rest + self.buf
        done_call = bool(self.close_tag) and self.emitted
        self.mode = "close" if done_call else "text" if self.marker else "plain"

    def _give_up(self, final: bool) -> None:
        """The scan failed (not JSON) or the answer ended inside it."""
        if self.open is not None and self.open.index is not None:
            self._progress()  # a call cut short keeps the arguments it has
        elif final and self.response is not None:
            self._response_progress(final=True)
        if not self.emitted:
            self._content(self.prefix + self.scan.text[: self.scan.end])
        self.buf = self.scan.text[self.scan.end :] + self.buf
        self.open = None
        self.mode = "text" if self.marker else "plain"
        if final:
            self._content(self.buf)
            self.buf = ""

    def is_call(self, span: Span) -> bool:
        """Whether the JSON value ``span`` (just opened) is a call object: by default the top-level value."""
        return span.kind == "{" and span.path == ()

    def _events(self, events: list[tuple[str, Span]]) -> None:
        text = self.scan.text
        for kind, span in events:
            call = self.open
            if kind == "start":
                if self.is_call(span):
                    self.open = _Open(span)
                elif call is not None and span.path[:-1] == call.span.path and call.args is None:
                    if span.path[-1] in _ARGS_KEYS:
                        call.args, call.raw_sent = span, span.start + 1
                elif self.response_key and span.path == (self.response_key,) and span.kind == '"':
                    self.response, self.response_sent = span, span.start + 1
                continue
            assert span.end is not None
            if call is not None and span is call.span:
                self._end_call(call)
            elif call is not None and span is call.args:
                self._args_progress(call, span.end)
            elif call is not None and span.path[:-1] == call.span.path and span.kind == '"':
                key = span.path[-1]
                if key in ("name", "id") and getattr(call, str(key)) is None:
                    setattr(call, str(key), json.loads(text[span.start : span.end]))
            elif span is self.response:
                self._response_progress(final=True)
            elif self.response_key and span.path == (self.response_key,):  # not a string: its JSON
                self._content(text[span.start : span.end])
                self.emitted = True

    def _end_call(self, call: _Open) -> None:
        self.open = None
        if call.name is None:
            return  # an object without a name: not a call
        if call.args is None:
            call.args_text = "{}"
        self._header(call)
        self._args(call, call.args_text[len(self.calls[call.index or 0].arguments) :])

    def _progress(self) -> None:
        call = self.open
        if call is not None and call.args is not None and call.args.end is None:  # ended: sent whole then
            self._args_progress(call, None)
        if self.response is not None:
            self._response_progress(final=False)

    def _args_progress(self, call: _Open, end: int | None) -> None:
        """The arguments as far as read (``end``: their end, once read); out once the name is known."""
        args = call.args
        assert args is not None
        text = self.scan.text
        if args.kind != '"':
            call.args_text = text[args.start : end if end is not None else self.scan.pos]
        else:
            upto = end - 1 if end is not None else self.scan.safe
            if upto > call.raw_sent:
                call.args_text += json.loads('"' + text[call.raw_sent : upto] + '"')
                call.raw_sent = upto
        if call.name is not None:
            self._header(call)
            self._args(call, call.args_text[len(self.calls[call.index or 0].arguments) :])

    def _response_progress(self, final: bool) -> None:
        span = self.response
        assert span is not None
        upto = span.end - 1 if span.end is not None else self.scan.safe
        if upto > self.response_sent:
            self._content(json.loads('"' + self.scan.text[self.response_sent : upto] + '"'))
            self.response_sent = upto
            self.emitted = True
        if span.end is not None or final:
            self.response = None
