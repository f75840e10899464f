"""Grammar-constrained sampling: GBNF text (or a JSON schema) to llama.cpp's grammar sampler.

The grammar format is llama.cpp's GBNF (``grammars/README.md`` of llama.cpp), whose start
rule is ``root``.  A JSON schema is turned into GBNF by llama-cpp-python's own converter
(``llama_cpp.llama_grammar.json_schema_to_gbnf``, a port of llama.cpp's
``json-schema-to-grammar``), as llama-server turns its ``json_schema`` field.
:data:`JSON_GBNF` (llama.cpp's ``grammars/json.gbnf``, shipped in the same module) is any
JSON value, for OpenAI's ``response_format: {"type": "json_object"}``.

Two inputs would crash the worker rather than fail cleanly, so they are refused before
llama.cpp sees them: llama.cpp parses GBNF by recursive descent, and a group nested about
20 000 deep overflowed the stack (segfault, measured on this build); the converter spells
``maxItems``/``maxLength`` ``n`` as ``n`` nested optional groups and ``minItems`` ``n`` as
``n`` copies, so those bounds (and regex ``{m,n}`` in ``pattern``) are capped too.
"""

from __future__ import annotations

import ctypes
import json
import re
from typing import Any

import llama_cpp as llama
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from contract.errors import ErrorCode

MAX_NESTING = 1000  # groups nested in a GBNF text (10 000 parsed fine, 20 000 overflowed the stack)
MAX_REPEAT = 1000  # the largest count a JSON schema may ask to repeat (minItems, maxLength, {m,n}...)
REPEAT_KEYS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"})
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

__all__ = ["JSON_GBNF", "GrammarError", "gbnf_of", "grammar_sampler"]


class GrammarError(Exception):
    """A grammar or JSON schema llama.cpp cannot use (``code``: ``INVALID_GRAMMAR``)."""

    code = ErrorCode.INVALID_GRAMMAR


def nesting_depth(gbnf: str) -> int:
    """How deep ``(`` groups nest in ``gbnf``, outside ``"..."`` literals, ``[...]`` classes and ``#`` comments."""
    depth = deepest = 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "#":
            while i < n and gbnf[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _check_counts(node: Any) -> None:
    """Refuse repetition counts above :data:`MAX_REPEAT` anywhere in a JSON schema."""
    if isinstance(node, list):
        for item in node:
            _check_counts(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in REPEAT_KEYS and isinstance(value, int) and value > MAX_REPEAT:
                raise GrammarError(f"json_schema: {key} {value} is above {MAX_REPEAT}")
            if key == "pattern" and isinstance(value, str):
                for m in _COUNT.finditer(value):
                    if any(g and int(g) > MAX_REPEAT for g in m.groups()):
                        raise GrammarError(f"json_schema: pattern repeats more than {MAX_REPEAT} times")
            _check_counts(value)


def gbnf_of(grammar: str, json_schema: str, schema_rule: str = "") -> str:
    """The GBNF to constrain sampling with: ``grammar`` if given, else ``json_schema`` (JSON text of
    a schema; ``{}`` is any JSON object, as llama-server reads it) converted, else ``""`` (none).

    With ``schema_rule`` (a GBNF rule name) and both texts, the schema's GBNF is appended to
    ``grammar`` with its ``root`` rule renamed ``schema_rule``, so that ``grammar`` can wrap JSON
    of that schema in other text (a tool call's ``<tool_call>...</tool_call>``, as llama-server's
    chat formats build their grammars from the tools' schemas in ``common/chat.cpp``).

    Raises :class:`GrammarError` for a schema that is not JSON or that the converter refuses.
    """
    if schema_rule and grammar and json_schema:
        converted = gbnf_of("", json_schema)
        renamed = re.sub(r"^root\s*::=", f"{schema_rule} ::=", converted, count=1, flags=re.MULTILINE)
        return grammar + "\n" + renamed
    if grammar or not json_schema:
        return grammar
    try:
        schema = json.loads(json_schema)
        if schema == {}:
            schema = {"type": "object"}
        _check_counts(schema)
        return json_schema_to_gbnf(json.dumps(schema))
    except RecursionError as exc:
        raise GrammarError("json_schema nests too deep") from exc
    except GrammarError:
        raise
    except ValueError as exc:
        raise GrammarError(f"json_schema is not JSON: {exc}") from exc
    except Exception as exc:  # the converter raises what it meets (KeyError, AssertionError, TypeError...)
        raise GrammarError(f"json_schema cannot be turned into a grammar: {type(exc).__name__}: {exc}") from exc


def grammar_sampler(vocab: llama.llama_vocab_p, gbnf: str, triggers: list[str] | None = None) -> llama.llama_sampler_p:
    """``llama_sampler_init_grammar(vocab, gbnf, "root")`` (``include/llama.h``); the caller frees it
    (or adds it to a chain).  With ``triggers`` (regexes, as llama-server's grammar triggers of
    ``common/sampling.cpp``): ``llama_sampler_init_grammar_lazy_patterns``, a grammar that allows
    every token until the output so far matches one of them, and constrains from the match's
    first capture group (else the whole match) on.  Raises :class:`GrammarError` when llama.cpp
    cannot parse ``gbnf`` (it returns NULL and logs why) or when it nests deeper than
    :data:`MAX_NESTING`."""
    if "\x00" in gbnf or any("\x00" in t for t in triggers or []):
        raise GrammarError("the grammar holds a NUL character")
    if nesting_depth(gbnf) > MAX_NESTING:
        raise GrammarError(f"grammar nests groups deeper than {MAX_NESTING}")
    if triggers:
        for t in triggers:
            try:
                re.compile(t)
            except re.error as exc:  # llama.cpp's std::regex would throw through the C API
                raise GrammarError(f"grammar trigger {t!r} is not a regex: {exc}") from exc
        pats = (ctypes.c_char_p * len(triggers))(*[t.encode() for t in triggers])
        none = (llama.llama_token * 1)()
        ptr = llama.llama_sampler_init_grammar_lazy_patterns(
            vocab, gbnf.encode(), b"root", pats, len(triggers), none, 0
        )
    else:
        ptr = llama.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    if not ptr:
        raise GrammarError(
            "llama.cpp cannot parse the grammar (a syntax error, an undefined rule, no 'root' rule, or left recursion)"
        )
    return ptr
