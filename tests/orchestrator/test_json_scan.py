"""The incremental JSON scanner under the streamed tool calls (``orchestrator/generation/json_scan.py``):
every value's span, read whole or a character at a time, is the text of that value (checked with
Python's ``json``), and text that is not JSON fails where it stops being JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.generation.json_scan import JsonScan

DOCS = [
    '{"a": [1, {"b": "x\\u00e9\\"}"}, true], "c": null, "d": -1.5e-3}',
    "[ ]",
    "{}",
    "12",
    '"s\\ud83d\\ude00"',
    ' {"name" : "add" ,\n "arguments" : { "k" : [ [ ] , { } ] } } trailing',
]


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


@pytest.mark.parametrize("doc", DOCS)
def test_spans_are_the_values(doc: str) -> None:
    for step in (1, 2, 5, len(doc)):
        scan = JsonScan()
        ends = []
        for i in range(0, len(doc), step):
            ends += [span for kind, span in scan.feed(doc[i : i + step]) if kind == "end"]
        ends += [span for kind, span in scan.close() if kind == "end"]
        assert scan.done and not scan.failed
        whole, end = json.JSONDecoder().raw_decode(doc, len(doc) - len(doc.lstrip()))
        assert scan.end == end and ends[-1].path == ()
        for span in ends:
            assert span.end is not None
            assert json.loads(doc[span.start : span.end]) == _at(whole, span.path)


@pytest.mark.parametrize(
    ("doc", "at"), [('{"a" 1}', 5), ("[1,]", 3), ('{"a": tru}', 6), ('"bad \\x"', 6), ("{'a': 1}", 1), ("nope", 0)]
)
def test_not_json_fails_where_it_stops_being_json(doc: str, at: int) -> None:
    scan = JsonScan()
    for c in doc:
        scan.feed(c)
    scan.close()
    assert scan.failed and not scan.done and scan.end == at


def test_safe_stops_before_a_half_written_escape() -> None:
    scan = JsonScan()
    scan.feed('"ab\\u00')
    assert scan.safe == 3  # after "ab"
    scan.feed("e9\\ud83d")
    assert scan.safe == 9  # a high surrogate waits for its pair
    scan.feed("\\ude00")
    assert scan.safe == 21 and json.loads(scan.text[:21] + '"') == "ab\u00e9\U0001f600"
