"""KoboldCpp's API: request bodies, response bodies and stream events (KoboldCpp's ``koboldcpp.py``).

A field typed ``... | UnsetType`` is left out when unset; ``None`` is sent as ``null``.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType


class KoboldResult(msgspec.Struct, kw_only=True):
    """KoboldCpp's ``results`` entry (``finish_reason`` length, stop or abort)."""

    text: str
    finish_reason: str | UnsetType | None = UNSET


class KoboldVersion(msgspec.Struct, kw_only=True):
    """``GET /api/extra/version``: ``result`` is "KoboldCpp" (clients check it), with feature flags."""

    result: str
    version: str
    protected: bool
    txt2img: bool
    vision: bool
    transcribe: bool
    multiplayer: bool
    websearch: bool
    tts: bool
    embeddings: bool
    server: str


class KoboldResultValue(msgspec.Struct, kw_only=True):
    """``{"result": ...}`` (``/api/v1/info/version``)."""

    result: str


class KoboldValue(msgspec.Struct, kw_only=True):
    """``{"value": n}`` (KoboldCpp's config endpoints: tokens)."""

    value: int


class KoboldTokenCount(msgspec.Struct, kw_only=True):
    """``POST /api/extra/tokencount``: the count and the ids."""

    value: int
    ids: list[int]


class KoboldAbort(msgspec.Struct, kw_only=True):
    """``POST /api/extra/abort``: KoboldCpp answers the strings "true"/"false"."""

    success: str
    done: str


class KoboldPending(msgspec.Struct, kw_only=True):
    """``/api/extra/generate/check``: the text generated so far."""

    results: list[KoboldResult]


class KoboldPerf(msgspec.Struct, kw_only=True):
    """``GET /api/extra/perf``: the last generation's times (s) and counts, and server status."""

    last_process: float
    last_eval: float
    last_token_count: int
    last_seed: int
    total_gens: int
    stop_reason: int
    total_img_gens: int
    queue: int
    idle: int
    hordeexitcounter: int
    uptime: float
    idletime: float
    quiet: bool


class GenkeyBody(msgspec.Struct, kw_only=True):
    """``{"genkey": "KCPP1234"}`` of abort and generate/check (optional)."""

    genkey: str = ""


class TokenCountBody(msgspec.Struct, kw_only=True):
    """``POST /api/extra/tokencount``: ``prompt`` and whether to add special tokens."""

    prompt: str = ""
    special: bool = True


KOBOLD_FINISH = {"length": "length", "stop_token": "stop", "stop_string": "stop", "cancelled": "abort"}
"""KoboldCpp's ``finish_reason`` of each of generation's finish reasons."""


class KoboldTokenEvent(msgspec.Struct, kw_only=True):
    """KoboldCpp's SSE event (``POST /api/extra/generate/stream``, ``event: message``): a piece of text,
    then a last event with ``token: ""`` and its ``finish_reason`` (length, stop or abort)."""

    token: str
    finish_reason: str | None = None


def kobold_done_event(finish_reason: str) -> KoboldTokenEvent:
    """The last KoboldCpp SSE event of a generation that ended for ``finish_reason`` (generation's name)."""
    return KoboldTokenEvent(token="", finish_reason=KOBOLD_FINISH.get(finish_reason, finish_reason))
