"""KoboldCpp's API: request bodies, response bodies and stream events (KoboldCpp's ``koboldcpp.py``).

A field typed ``... | UnsetType`` is left out when unset; ``None`` is sent as ``null``.
"""

from __future__ import annotations

import msgspec

from orchestrator.api.common.kobold import KoboldResult


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
