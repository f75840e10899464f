"""An incremental JSON scanner: reads one JSON value (RFC 8259) a piece of text at a time and says
where each value inside it starts and ends, so a caller can act on a document before it is complete.

It plays the part of llama.cpp's partial parsing for streamed tool calls (``common_chat_parse`` with
``is_partial``, ``common/chat.cpp``, over the PEG parser of ``common/peg-parser.cpp`` and
``common/chat-peg-parser.cpp`` of the pinned llama.cpp: a call's name and arguments are known, and
sent, while the model is still writing them) without re-parsing the whole text at each token: each
character is looked at once.  Positions are indices into the text the scanner was fed, counted from its first
character.  Values are located by their *path*: a tuple of object keys (``str``) and array indices
(``int``) from the top-level value (``()``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, auto

_SPACE = " \t\r\n"
_SCALAR = frozenset("0123456789+-.eEtruefalsn")
_HEX = frozenset("0123456789abcdefABCDEF")


class _State(Enum):
    VALUE = auto()  # a value is expected
    FIRST_KEY = auto()  # after "{": a key or "}"
    NEXT_KEY = auto()  # after "," in an object: a key
    KEY = auto()  # inside a key's string
    COLON = auto()
    STRING = auto()  # inside a string value
    SCALAR = auto()  # inside a number, true, false or null
    FIRST_ITEM = auto()  # after "[": a value or "]"
    AFTER = auto()  # after a value: "," or the container's end
    DONE = auto()  # the top-level value is complete
    FAILED = auto()  # not JSON


@dataclass
class Span:
    """A value seen: its ``path``, ``start`` (its first character) and, once known, ``end`` (one past
    its last character); ``kind`` is its first character (``{``, ``[``, ``"``, or a scalar's)."""

    path: tuple[str | int, ...]
    start: int
    kind: str
    end: int | None = None


@dataclass
class _Frame:
    span: Span
    is_object: bool
    key: str = ""
    count: int = 0


@dataclass
class JsonScan:
    """Scans one JSON value fed in pieces (:meth:`feed`); :attr:`events` lists the :class:`Span` s
    opened (``("start", span)``) and closed (``("end", span)``) by the last feed, in order.

    After the top-level value :attr:`done` is true and :attr:`end` is the index just past it; text fed
    after that is not read.  Text that is not JSON sets :attr:`failed` (at :attr:`end`).  While a
    string value is open, :attr:`safe` is the index up to which its raw text decodes on its own (not
    inside an escape, nor after a high surrogate ``\\uD8xx`` still waiting for its pair)."""

    text: str = ""
    pos: int = 0
    events: list[tuple[str, Span]] = field(default_factory=list)
    safe: int = 0
    _state: _State = _State.VALUE
    _stack: list[_Frame] = field(default_factory=list)
    _string: Span | None = None  # the open string value or key
    _escape: int = 0  # characters of an escape still to come (-1: the one after the backslash)
    _surrogate: bool = False  # the last escape was a high surrogate
    _scalar: Span | None = None

    @property
    def done(self) -> bool:
        """Whether the top-level value is complete."""
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        """Whether the text is not JSON."""
        return self._state is _State.FAILED

    @property
    def end(self) -> int:
        """Where scanning stopped: just past the value when :attr:`done`, at the bad character when
        :attr:`failed`, else the length of the text fed."""
        return self.pos

    def feed(self, piece: str) -> list[tuple[str, Span]]:
        """Read ``piece`` (appended to :attr:`text`); returns (and keeps in :attr:`events`) the spans
        started and ended while reading it."""
        self.text += piece
        self.events = []
        while self.pos < len(self.text) and self._state not in (_State.DONE, _State.FAILED):
            self._step(self.text[self.pos])
        return self.events

    def close(self) -> list[tuple[str, Span]]:
        """The text is complete: a number at the very end ends (``12`` is a whole document)."""
        self.events = []
        if self._state is _State.SCALAR and not self._stack:
            self._end_scalar()
        return self.events

    # ------------------------------------------------------------------ the state machine

    def _path(self) -> tuple[str | int, ...]:
        if not self._stack:
            return ()
        top = self._stack[-1]
        return (*top.span.path, top.key if top.is_object else top.count)

    def _open(self, kind: str) -> Span:
        span = Span(self._path(), self.pos, kind)
        self.events.append(("start", span))
        return span

    def _close(self, span: Span, end: int) -> None:
        span.end = end
        self.events.append(("end", span))
        self._state = _State.AFTER if self._stack else _State.DONE

    def _end_scalar(self) -> None:
        span = self._scalar
        assert span is not None
        try:
            json.loads(self.text[span.start : self.pos])
        except ValueError:
            self._state = _State.FAILED
            self.pos = span.start  # a bad scalar fails where it starts
            return
        self._scalar = None
        self._close(span, self.pos)

    def _step(self, c: str) -> None:
        state = self._state
        if state in (_State.STRING, _State.KEY):
            self._string_char(c)
            self.pos += 1
            return
        if state is _State.SCALAR:
            if c in _SCALAR:
                self.pos += 1
            else:
                self._end_scalar()  # then read c again after the value
            return
        if c in _SPACE:
            self.pos += 1
            return
        if (state is _State.FIRST_ITEM and c == "]") or (state is _State.FIRST_KEY and c == "}"):
            self._close_container()
            return
        if state in (_State.VALUE, _State.FIRST_ITEM):
            self._value(c)
        elif state in (_State.FIRST_KEY, _State.NEXT_KEY):
            if c != '"':
                self._state = _State.FAILED
                return
            self._string = Span(self._path(), self.pos, '"')
            self._state = _State.KEY
            self._escape, self._surrogate = 0, False
            self.pos += 1
        elif state is _State.COLON:
            if c != ":":
                self._state = _State.FAILED
                return
            self._state = _State.VALUE
            self.pos += 1
        elif state is _State.AFTER:
            top = self._stack[-1]
            if c == ",":
                if top.is_object:
                    self._state = _State.NEXT_KEY
                else:
                    top.count += 1
                    self._state = _State.VALUE
                self.pos += 1
            elif c == ("}" if top.is_object else "]"):
                self._close_container()
            else:
                self._state = _State.FAILED

    def _close_container(self) -> None:
        frame = self._stack.pop()
        self.pos += 1
        self._close(frame.span, self.pos)

    def _value(self, c: str) -> None:
        if c in "{[":
            span = self._open(c)
            self._stack.append(_Frame(span, c == "{"))
            self._state = _State.FIRST_KEY if c == "{" else _State.FIRST_ITEM
        elif c == '"':
            self._string = self._open(c)
            self._state = _State.STRING
            self._escape, self._surrogate = 0, False
            self.safe = self.pos + 1
        elif c in _SCALAR:
            self._scalar = self._open(c)
            self._state = _State.SCALAR
        else:
            self._state = _State.FAILED
            return
        self.pos += 1

    def _string_char(self, c: str) -> None:
        if self._escape == -1:  # the character after a backslash
            if c == "u":
                self._escape = 4
                return
            if c not in '"\\/bfnrt':
                self._state = _State.FAILED
                self.pos -= 1  # stays at the bad character
                return
            self._escape = 0
        elif self._escape > 0:
            if c not in _HEX:
                self._state = _State.FAILED
                self.pos -= 1
                return
            self._escape -= 1
            if self._escape:
                return
            high = 0xD800 <= int(self.text[self.pos - 3 : self.pos + 1], 16) <= 0xDBFF
            if high:
                self._surrogate = True
                return
        elif c == "\\":
            self._escape = -1
            return
        elif c == '"':
            span = self._string
            assert span is not None
            self._string = None
            if self._state is _State.KEY:
                top = self._stack[-1]
                top.key = json.loads(self.text[span.start : self.pos + 1])
                self._state = _State.COLON
                return
            self.safe = self.pos
            self._close(span, self.pos + 1)
            return
        elif c < " ":
            self._state = _State.FAILED
            self.pos -= 1
            return
        self._surrogate = False
        self.safe = self.pos + 1
