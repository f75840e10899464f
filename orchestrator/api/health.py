"""``GET /health`` (llama-server's: 200 ok, 503 while loading or without a model) with store and slot status.

While the model loads: 503 with ``{"status": "loading", "progress": <fraction 0..1>}``
(llama.cpp's model-load progress callback, relayed by the worker).
"""

from __future__ import annotations

from typing import Any

from litestar import Response, get

from orchestrator.engine_client import EngineClient
from orchestrator.services import Services


def _engine_state(client: EngineClient) -> str:
    if client.alive:
        return "ready"
    return "loading" if client.generation == 0 else "down"


@get(["/health", "/v1/health"], summary="Liveness: ok, loading (with progress), degraded (store down) or error")
async def health(services: Services) -> Response[dict[str, Any]]:
    engine_ok = services.engine.alive
    store_ok = True
    if services.persistence is not None:
        store_ok = await services.persistence.check()
    state = _engine_state(services.engine)
    status = ("ok" if store_ok else "degraded") if engine_ok else ("loading" if state == "loading" else "error")
    slots = list(services.registry.slots.values())
    body: dict[str, Any] = {
        "status": status,
        "engine": state,
        "store": "ok" if store_ok else "unavailable",
        "slots_idle": sum(1 for s in slots if not s.busy),
        "slots_processing": sum(1 for s in slots if s.busy),
    }
    if state == "loading":
        body["progress"] = round(services.engine.load_progress, 4)
    if services.classifier is not None:
        body["classifier"] = _engine_state(services.classifier)
        if body["classifier"] == "loading":
            body["classifier_progress"] = round(services.classifier.load_progress, 4)
    if not engine_ok:
        body["error"] = {"code": 503, "message": "Loading model" if state == "loading" else "Engine down"}
        body["error_code"] = "NO_MODEL"
    return Response(body, status_code=200 if engine_ok else 503)
