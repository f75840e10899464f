"""KoboldCpp's generation semantics, shared by the KoboldCpp surface and the native generate routes
(``POST /api/v1/generate``, ``POST /api/extra/generate/stream``: KoboldCpp's paths, extended with attention).

:func:`prepare` turns a Kobold generation body into a canonical request the way KoboldCpp reads it
(``koboldcpp.py`` ``generate``): KoboldCpp's defaults (:data:`KOBOLD_DEFAULTS`) for what the body leaves out,
``memory`` before the prompt, string ``banned_tokens``/``banned_strings``,
``use_default_badwordsids``/``ban_eos_token`` (end-of-generation tokens banned), ``bypass_eos``
(they do not stop), and a prompt over the window trimmed from the front when the client sends
``max_context_length`` (as Lite and SillyTavern do), and KoboldCpp's ContextShift default for the cache:
a body without ``n_cache_reuse`` reuses the cache of a context pruned in its middle
(:data:`KOBOLD_CACHE_REUSE`) unless the server runs with ``--noshift``.  Fields this server cannot honour
are named in one warning line.  :class:`KoboldJobs` tracks running generations by ``genkey`` for abort and ``perf``;
:class:`KoboldTokenEvent`/:class:`KoboldResult` are the events and results both routes send."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from msgspec import UNSET, UnsetType

from contract.errors import ErrorCode
from contract.options import SamplingParams
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.generation.events import DoneOut
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.service import RunControl
from orchestrator.llama_metrics import LLAMA_SERVER
from orchestrator.services import Services
from orchestrator.tenants.principal import principal_of
from orchestrator.web.errors import ApiError

log = structlog.get_logger("slotserve.kobold")


class KoboldResult(msgspec.Struct, kw_only=True):
    """KoboldCpp's ``results`` entry (``finish_reason`` length, stop or abort)."""

    text: str
    finish_reason: str | UnsetType | None = UNSET


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


STOP_REASON = {"length": 0, "stop_token": 1, "stop_string": 2, "cancelled": 0}
"""KoboldCpp's ``stop_reason`` (``expose.h``: INVALID -1, OUT_OF_TOKENS 0, EOS_TOKEN_HIT 1, CUSTOM_STOPPER 2).
``gpttype_generate`` sets OUT_OF_TOKENS when a generation starts and changes it only for an end-of-stream
token or a stop string, so an aborted generation reports 0."""


# Sampler fields Lite/SillyTavern send; a value other than the neutral one cannot be honoured.
# (llama.cpp has no top-a, tail-free, smoothing or slope sampler; typical, nsigma, presence_penalty,
# dynatemp_range, DRY, XTC, Mirostat, logit_bias and grammar are honoured.)
NEUTRAL = {"top_a": 0, "tfs": 1, "smoothing_factor": 0, "rep_pen_slope": 1}


KOBOLD_DEFAULTS = SamplingParams(
    max_new_tokens=200, temperature=0.75, top_k=100, top_p=0.92, min_p=0.0, typical_p=1.0,
    repeat_penalty=1.0, repeat_last_n=320, presence_penalty=0.0, mirostat=0, mirostat_tau=5.0, mirostat_eta=0.1,
    dry_multiplier=0.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=320, dry_sequence_breakers=[],
    xtc_threshold=0.2, xtc_probability=0.0, dynatemp_range=0.0, dynatemp_exponent=1.0, seed=-1,
)  # fmt: skip
"""What KoboldCpp uses for a field its ``/api/v1/generate`` body leaves out: ``koboldcpp.py``
``generate()`` (KoboldCpp 1.82.4, the release this API follows: ``max_length`` 200, ``temperature``
0.75, ``top_k`` 100, ``top_p`` 0.92, ``min_p`` 0, ``typical`` 1, ``rep_pen`` 1, ``rep_pen_range``
320, Mirostat tau 5 / eta 0.1, DRY base 1.75 / allowed length 2 / window 320 / no sequence
breakers, XTC threshold 0.2; ``tfs`` 1, ``top_a`` 0, ``rep_pen_slope`` 1 are the neutral values of
:data:`NEUTRAL`).  llama-server's defaults (``contract.options.SamplingParams``) serve the other routes."""

KOBOLD_CACHE_REUSE = 64
"""``n_cache_reuse`` (tokens) of a Kobold body that leaves it out, while the server runs without
``--noshift`` and without ``--cache-reuse``: runs of at least 64 tokens that the request continues with
and the slot's cache holds after a pruned middle are moved into place by a KV shift instead of prefilled
(llama-server's cache reuse, docs/api.md "Cache reuse").  KoboldCpp's ContextShift does this by default
(``PurgeMissingTokens`` in ``gpttype_adapter.cpp``: one removed block, the rest kept when at least
``200 + min(n_ctx / 30, 140)`` tokens follow the common prefix); 64 also keeps the shorter runs between
several pruned chunks, as Halo Weave prunes them."""


@dataclass
class Job:
    """A running Kobold generation: how to stop it and its text so far."""

    control: RunControl
    seed: int = -1
    text: list[str] = field(default_factory=list)
    n_generated: int = 0
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once it stopped and left its slot


@dataclass
class KoboldJobs:
    """Running generations by ``genkey`` and KoboldCpp's ``perf`` figures (one per app)."""

    running: dict[str, list[Job]] = field(default_factory=dict)
    last_process_s: float = 0.0
    last_eval_s: float = 0.0
    last_token_count: int = 0
    stop_reason: int = -1
    last_seed: int = -1
    total_gens: int = 0
    started: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)

    @contextmanager
    def track(self, genkey: str | None, control: RunControl, seed: int = -1) -> Iterator[Job]:
        """Register a generation under ``genkey`` (``""`` when the client sent none) while it runs.

        One that ends without :meth:`finished` (its client left: KoboldAI Lite's Abort closes its
        stream) is counted as KoboldCpp counts an aborted one: ``stop_reason`` 0, its tokens so far
        (``Job.n_generated``), its time as ``last_eval``."""
        key = genkey or ""
        job = Job(control, seed)
        self.running.setdefault(key, []).append(job)
        self.last_request = time.time()
        try:
            yield job
        finally:
            job.ended.set()
            jobs = self.running[key]
            jobs.remove(job)
            if not jobs:
                del self.running[key]
            if not job.done and (job.n_generated or job.control.req is not None):
                self._record(0.0, time.monotonic() - job.started, job.n_generated, 0, job.seed)

    def finished(self, job: Job, done: DoneOut) -> None:
        """Record ``job``'s end (the engine's ``done``) for ``/api/extra/perf``."""
        job.done = True
        reason = STOP_REASON.get(done.finish_reason, -1)
        self._record(done.t_prefill_ms / 1000, done.t_generate_ms / 1000, done.n_generated, reason, job.seed)

    def _record(self, process_s: float, eval_s: float, n_tokens: int, reason: int, seed: int) -> None:
        self.last_process_s, self.last_eval_s, self.last_token_count = process_s, eval_s, n_tokens
        self.stop_reason, self.last_seed = reason, seed
        self.total_gens += 1
        self.last_request = time.time()


def jobs_of(request: ASGIConnection[Any, Any, Any, Any]) -> KoboldJobs:
    """The :class:`KoboldJobs` of the request's tenant (created on first use): a ``genkey``, the text
    so far, an abort and ``perf``'s figures never reach another tenant's generations."""
    state: State = request.app.state
    tenants: dict[str, KoboldJobs] | None = state.get("kobold_jobs")
    if tenants is None:
        tenants = state["kobold_jobs"] = {}
    tenant = principal_of(request).tenant
    jobs = tenants.get(tenant)
    if jobs is None:
        jobs = tenants[tenant] = KoboldJobs(started=LLAMA_SERVER.t_start)
    return jobs


def _warn_unsupported(data: GenerateRequest, raw: dict[str, Any]) -> None:
    names = [k for k, v in NEUTRAL.items() if isinstance(raw.get(k), int | float) and raw[k] != v]
    if raw.get("grammar_retain_state") is True:
        names.append("grammar_retain_state")
    if data.n is not None and data.n > 1:
        names.append("n>1 (one result is generated)")
    if names:
        log.warning("Kobold fields not supported, ignored", fields=names)


async def _banned_ids(services: Services, words: list[str]) -> list[int]:
    """KoboldCpp's string bans: a one-character string bans every token containing it (case-
    insensitive); a longer string that is one token bans that token.  Phrase bans of several
    tokens need backtracking (KoboldCpp's anti-slop), which this server does not do: warned."""
    pieces = await services.generation.pieces()
    out: set[int] = set()
    for w in (w.lower() for w in words if w):
        if len(w) == 1:
            out.update(i for i, p in enumerate(pieces) if w in p.decode("utf-8", "replace").lower())
            continue
        ids = (await services.engine.tokenize(w, False, False)).ids
        if len(ids) == 1:
            out.add(ids[0])
        else:
            log.warning("banned phrase of several tokens not supported, ignored", phrase=w)
    return sorted(out)


async def prepare(services: Services, data: GenerateRequest, raw: dict[str, Any] | None = None) -> CanonicalRequest:
    """The canonical request for a Kobold/seed body (see module docstring); ``raw`` is the JSON body."""
    req = data.canonical(KOBOLD_DEFAULTS)
    raw = raw or {}
    if req.n_cache_reuse is None and not services.settings.noshift and not services.settings.worker.engine.cache_reuse:
        req.n_cache_reuse = KOBOLD_CACHE_REUSE  # KoboldCpp's ContextShift default (KOBOLD_CACHE_REUSE)
    _warn_unsupported(data, raw)
    if raw.get("bypass_eos") is True:  # KoboldCpp: end-of-stream tokens do not stop the generation
        req.ignore_eos = True
    if raw.get("use_default_badwordsids") is True or raw.get("ban_eos_token") is True:  # they are never sampled
        req.banned_tokens = sorted(set(req.banned_tokens) | set(services.generation.info.eog_token_ids))
    words = [t for t in (data.banned_tokens or []) if isinstance(t, str)] + list(data.banned_strings or [])
    if words:
        req.banned_tokens = sorted(set(req.banned_tokens) | set(await _banned_ids(services, words)))
    if data.input_ids is None and (data.memory or data.max_context_length is not None) and data.prompt is not None:
        info = services.generation.info
        memory = (await services.engine.tokenize(data.memory, False, True)).ids if data.memory else []
        prompt = (await services.engine.tokenize(data.prompt, False, True)).ids
        if data.max_context_length is not None:
            window = min(data.max_context_length, info.n_ctx)
            room = window - req.max_new_tokens - len(memory)
            if room < 1:
                raise ApiError(
                    ErrorCode.CONTEXT_OVERFLOW,
                    f"max_length {req.max_new_tokens} + memory {len(memory)} leave no room in a context of {window}",
                    n_ctx=window,
                    context_length=len(memory) + len(prompt),
                )
            if len(prompt) > room:  # KoboldCpp keeps the end of the story
                log.info("prompt trimmed from the front", n_prompt=len(prompt), kept=room)
                prompt = prompt[len(prompt) - room :]
        req.input_ids, req.prompt = memory + prompt, None
    return req
