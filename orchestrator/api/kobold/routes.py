"""KoboldCpp's API around generation, as KoboldAI Lite and SillyTavern poll it.

Paths and field names are KoboldCpp's (``koboldcpp.py``: ``do_GET``/``do_POST`` and
``generate``): ``GET /api/extra/version`` (``{"result": "KoboldCpp", "version"}``; without it
those clients fall back to the old KoboldAI protocol, with no streaming and no stop
sequences), ``/api/v1/info/version``, ``/api/v1/config/max_context_length``,
``/api/v1/config/max_length``, ``/api/extra/true_max_context_length``, ``POST
/api/extra/tokencount``, ``POST /api/extra/abort`` (by ``genkey``),
``/api/extra/generate/check`` (the text so far) and ``GET /api/extra/perf``.

The generate routes themselves and KoboldCpp's request semantics (:func:`orchestrator.api.common.kobold.prepare`)
are shared with the native API (``orchestrator/api/common/kobold.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog
from litestar import Controller, Request, get, post

from orchestrator.api.common.kobold import KOBOLD_DEFAULTS, KoboldResult, jobs_of
from orchestrator.api.kobold.protocol import (
    GenkeyBody,
    KoboldAbort,
    KoboldPending,
    KoboldPerf,
    KoboldResultValue,
    KoboldTokenCount,
    KoboldValue,
    KoboldVersion,
    TokenCountBody,
)
from orchestrator.services import Services
from orchestrator.tenants.principal import principal_of
from orchestrator.web.body import decode_json_body
from orchestrator.web.errors import ERROR_RESPONSES

log = structlog.get_logger("slotserve.kobold")

KOBOLDCPP_VERSION = "1.82.4"  # the KoboldCpp release whose API this follows
KOBOLD_API_VERSION = "1.2.5"  # /api/v1/info/version, as KoboldCpp answers
ABORT_WAIT_S = 10.0  # the longest /api/extra/abort waits for the generations it stops


class KoboldController(Controller):
    """KoboldCpp's version, config and ``extra`` endpoints (KoboldCpp's field names)."""

    @get("/api/extra/version", summary="KoboldCpp: server name and version", responses=ERROR_RESPONSES)
    async def version(self) -> KoboldVersion:
        return KoboldVersion(result="KoboldCpp", version=KOBOLDCPP_VERSION, protected=False, txt2img=False,
                             vision=False, transcribe=False, multiplayer=False, websearch=False, tts=False,
                             embeddings=False, server="slotserve")  # fmt: skip

    @get("/api/v1/info/version", summary="KoboldAI API version", responses=ERROR_RESPONSES)
    async def api_version(self) -> KoboldResultValue:
        return KoboldResultValue(result=KOBOLD_API_VERSION)

    @get("/api/v1/config/max_context_length", summary="KoboldCpp: context window, tokens", responses=ERROR_RESPONSES)
    async def max_context_length(self, services: Services) -> KoboldValue:
        return KoboldValue(value=services.generation.info.n_ctx)

    @get("/api/extra/true_max_context_length", summary="KoboldCpp: context window, tokens", responses=ERROR_RESPONSES)
    async def true_max_context_length(self, services: Services) -> KoboldValue:
        return KoboldValue(value=services.generation.info.n_ctx)

    @get("/api/v1/config/max_length", summary="KoboldCpp: default generation length, tokens", responses=ERROR_RESPONSES)
    async def max_length(self) -> KoboldValue:
        return KoboldValue(value=KOBOLD_DEFAULTS.max_new_tokens)

    @post(
        "/api/extra/tokencount",
        status_code=200,
        summary="KoboldCpp: count a prompt's tokens",
        responses=ERROR_RESPONSES,
    )
    async def tokencount(self, request: Request[Any, Any, Any], services: Services) -> KoboldTokenCount:
        body = decode_json_body(await request.body(), TokenCountBody)
        ids = (await services.engine.tokenize(body.prompt, body.special, True)).ids
        return KoboldTokenCount(value=len(ids), ids=ids)

    @post(
        "/api/extra/abort",
        status_code=200,
        summary="KoboldCpp: stop the generation of a genkey",
        responses=ERROR_RESPONSES,
    )
    async def abort(self, request: Request[Any, Any, Any]) -> KoboldAbort:
        body = decode_json_body(await request.body(), GenkeyBody)
        running = jobs_of(request).running.get(body.genkey, [])
        if not running:
            return KoboldAbort(success="false", done="false")
        stopping = list(running)
        for job in stopping:  # without a genkey: every generation started without one
            await job.control.cancel()
        # KoboldCpp answers once the generation had time to stop (koboldcpp.py sleeps 0.1 s); here once it
        # has stopped and left its slot, so the client's next turn finds the slot free
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(job.ended.wait() for job in stopping)), ABORT_WAIT_S)
        return KoboldAbort(success="true", done="true")

    @get("/api/extra/generate/check", summary="KoboldCpp: text generated so far", responses=ERROR_RESPONSES)
    async def check_get(self, request: Request[Any, Any, Any]) -> KoboldPending:
        return self._pending(request, "")

    @post(
        "/api/extra/generate/check",
        status_code=200,
        summary="KoboldCpp: text generated so far for a genkey",
        responses=ERROR_RESPONSES,
    )
    async def check_post(self, request: Request[Any, Any, Any]) -> KoboldPending:
        return self._pending(request, decode_json_body(await request.body(), GenkeyBody).genkey)

    @staticmethod
    def _pending(request: Request[Any, Any, Any], genkey: str) -> KoboldPending:
        running = jobs_of(request).running.get(genkey)
        return KoboldPending(results=[KoboldResult(text="".join(running[0].text) if running else "")])

    @get("/api/extra/perf", summary="KoboldCpp: last generation's figures and server status", responses=ERROR_RESPONSES)
    async def perf(self, request: Request[Any, Any, Any], services: Services) -> KoboldPerf:
        jobs = jobs_of(request)
        now = time.time()
        tenant = principal_of(request).tenant  # the caller's own generations and queue, as every figure here
        busy = any(s.busy for s in services.registry.of_tenant(tenant))
        return KoboldPerf(
            last_process=jobs.last_process_s,
            last_eval=jobs.last_eval_s,
            last_token_count=jobs.last_token_count,
            last_seed=jobs.last_seed,
            total_gens=jobs.total_gens,
            stop_reason=jobs.stop_reason,
            total_img_gens=0,
            queue=services.registry.waiting_of(tenant),
            idle=0 if busy else 1,
            hordeexitcounter=-1,
            uptime=now - jobs.started,
            idletime=now - jobs.last_request,
            quiet=False,
        )
