"""``GET /health`` (llama-server's: 200 ok, 503 while no model) with store and slot status; ``GET /metrics``
(slotserve's and llama-server's metrics)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import MediaType, Request, Response, get
from litestar.openapi import ResponseSpec
from litestar.plugins.prometheus import PrometheusController

from contract.errors import ErrorCode
from orchestrator.api.native.protocol import HealthError, HealthResponse
from orchestrator.llama_metrics import LLAMA_SERVER, PROCESS_START_HEADER
from orchestrator.services import Services
from orchestrator.slots.model import Slot
from orchestrator.tenants.principal import Principal, principal_if_known


def visible_slots(services: Services, principal: Principal | None) -> list[Slot]:
    """The slots on this node a caller's status figures count: every tenant's for an admin, its own
    tenant's for a user, none for an unknown caller (``principal`` None)."""
    if principal is None:
        return []
    return services.registry.of_tenant(None if principal.admin else principal.tenant)


@get(
    ["/health", "/v1/health"],
    summary="Liveness: ok, degraded (store down), 503 loading (start-up stage and load fraction) or down",
    responses={503: ResponseSpec(HealthResponse, description="no engine: the health body with error and error_code")},
)
async def health(request: Request[Any, Any, Any], services: Services) -> Response[HealthResponse]:
    """llama-server's ``/health`` body; ``slots_idle`` / ``slots_processing`` count the caller's
    tenant's slots on this node (every tenant's for an admin, or with no key configured; none for a
    caller who shows no valid key while keys are configured: docs/operations.md, "Tenants")."""
    engine_ok = services.engine.alive
    store_ok = True
    if services.archive is not None:
        store_ok = await services.archive.check()
    status = "ok" if engine_ok and store_ok else ("degraded" if engine_ok else "error")
    slots = visible_slots(services, principal_if_known(request))
    body = HealthResponse(
        status=status,
        engine="ready" if engine_ok else "down",
        store="ok" if store_ok else "unavailable",
        slots_idle=sum(1 for s in slots if not s.busy),
        slots_processing=sum(1 for s in slots if s.busy),
    )
    engine = services.engine
    if engine_ok and engine.info is not None:
        body.engine_config = msgspec.to_builtins(engine.info.runtime)
    if services.classifier is not None:
        body.classifier = "ready" if services.classifier.alive else "loading"
    if not engine_ok:
        loading = engine.generation == 0
        body.error = HealthError(code=503, message="Loading model" if loading else "Engine down")
        body.error_code = ErrorCode.NO_MODEL
        body.engine = body.status = "loading" if loading else "down"
        body.stage = engine.stage
        if engine.stage == "loading_model":
            body.progress = round(engine.load_fraction, 3)
    return Response(body, status_code=200 if engine_ok else 503)


class MetricsController(PrometheusController):
    """``GET /metrics``: Litestar's Prometheus exposition (slotserve's metrics), then llama-server's
    ``llamacpp:*`` metrics and its ``Process-Start-Time-Unix`` header
    (:mod:`orchestrator.llama_metrics`), documented as the text it is."""

    @get(media_type=MediaType.TEXT, summary="Prometheus metrics (text exposition format)")
    async def get(self, services: Services) -> Response[bytes]:
        own: Response[bytes] = await PrometheusController.get.fn(self)
        slots = services.registry.slots.values()  # an admin's (or no key configured): every tenant's
        llama = LLAMA_SERVER.render(sum(1 for s in slots if s.busy), services.registry.n_waiting)
        headers = {**own.headers, PROCESS_START_HEADER: str(LLAMA_SERVER.t_start)}
        return Response(own.content + llama.encode(), headers=headers)
