"""``GET /health`` (llama-server's: 200 ok, 503 while no model) with store and slot status."""

from __future__ import annotations

from typing import Any

from litestar import Response, get

from orchestrator.services import Services


@get(["/health", "/v1/health"], summary="Liveness: ok, degraded (store down) or 503 (no engine)")
async def health(services: Services) -> Response[dict[str, Any]]:
    engine_ok = services.engine.alive
    store_ok = True
    if services.persistence is not None:
        store_ok = await services.persistence.check()
    status = "ok" if engine_ok and store_ok else ("degraded" if engine_ok else "error")
    slots = list(services.registry.slots.values())
    body: dict[str, Any] = {
        "status": status,
        "engine": "ready" if engine_ok else "down",
        "store": "ok" if store_ok else "unavailable",
        "slots_idle": sum(1 for s in slots if not s.busy),
        "slots_processing": sum(1 for s in slots if s.busy),
    }
    if services.classifier is not None:
        body["classifier"] = "ready" if services.classifier.alive else "loading"
    if not engine_ok:
        body["error"] = {"code": 503, "message": "Loading model" if services.engine.generation == 0 else "Engine down"}
        body["error_code"] = "NO_MODEL"
    return Response(body, status_code=200 if engine_ok else 503)
