"""The Litestar application: routes, CORS, errors, logging, metrics, and the lifespan
that owns the engine worker, the slot registry and the state store."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from litestar import Litestar, Request
from litestar.config.cors import CORSConfig
from litestar.data_extractors import ResponseExtractorField
from litestar.di import Provide
from litestar.logging.config import StructLoggingConfig
from litestar.middleware.logging import LoggingMiddlewareConfig
from litestar.openapi import OpenAPIConfig
from litestar.plugins.prometheus import PrometheusConfig
from litestar.plugins.structlog import StructlogConfig, StructlogPlugin

from contract.errors import ErrorCode
from orchestrator import metrics
from orchestrator.api.native.generate import GenerateController
from orchestrator.api.native.health import MetricsController, health
from orchestrator.api.native.model import ModelController
from orchestrator.api.native.ws import binary_stream, event_stream
from orchestrator.config import Settings
from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.interface import EngineClient
from orchestrator.engine_client.lazy import LazyWorker
from orchestrator.generation.feed import AttentionFeed
from orchestrator.generation.service import GenerationService
from orchestrator.llama_metrics import LLAMA_SERVER
from orchestrator.services import Services, provide_services, provide_slot_ops
from orchestrator.slots.admission import AdmissionQueue
from orchestrator.slots.anonymous import AnonymousSlots
from orchestrator.slots.leases import LeaseKeeper
from orchestrator.slots.persistence import SlotArchive
from orchestrator.slots.registry import Slot, SlotRegistry
from orchestrator.web.auth import api_key_middleware
from orchestrator.web.errors import EXCEPTION_HANDLERS, ApiError
from orchestrator.web.header_case import canonical_header_names
from orchestrator.web.origins import CORS_METHODS, origin_middleware, preflight_ok
from orchestrator.web.slot_header import slot_header_middleware

log = structlog.get_logger("slotserve")

# Never log bodies (attention, SES1 states, conversations) or query strings (api_key).
RESPONSE_LOG_FIELDS: tuple[ResponseExtractorField, ...] = ("status_code",)


def build_services(settings: Settings) -> Services:
    """Create (not start) the long-lived objects."""
    engine = WorkerClient(settings.worker, window=settings.stream_window, window_bytes=settings.stream_window_bytes)
    archive = leases = None
    if settings.persist:

        def fingerprint() -> str:
            if engine.info is None:
                raise ApiError(ErrorCode.NO_MODEL, "No model loaded")
            return engine.info.fingerprint

        archive = SlotArchive.from_settings(settings, fingerprint)
        # Stable across restarts of the same node, so a restarted node takes its leases back.
        node_id = settings.node_id or f"{socket.gethostname()}:{settings.port}"
        leases = LeaseKeeper(archive, node_id, settings.lease_ms)
    queue: AdmissionQueue[Slot] = AdmissionQueue(settings.queue_size, settings.queue_timeout_s)
    registry = SlotRegistry(
        engine,
        settings.worker.engine.n_slots,
        archive,
        leases,
        queue,
        write_delay_s=settings.write_delay_ms / 1000,
        park_idle_s=settings.park_idle_s or None,
        strict=settings.durability == "strict",
    )
    registry.wait_s = settings.slot_wait_s
    classifier = WorkerClient(settings.classifier) if settings.classifier is not None else None
    feed = AttentionFeed()  # the admin page's live view of generated tokens
    anonymous = AnonymousSlots(registry, settings.slot_prompt_similarity, settings.anon_slots)
    generation = GenerationService(engine, registry, anonymous, feed)
    generation.default_seed = settings.seed
    LLAMA_SERVER.n_batch = settings.worker.engine.n_batch  # llama-server's n_decode_total counts prefill chunks
    embedder = LazyWorker(settings.embedder) if settings.embedder is not None else None
    return Services(settings, engine, registry, generation, archive, classifier, feed, embedder)


def create_app(settings: Settings, services: Services | None = None) -> Litestar:
    """The slotserve ASGI app for ``settings`` (``services`` injectable for tests)."""
    svc = services or build_services(settings)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.services = svc
        await svc.registry.start()

        async def on_restart() -> None:
            metrics.ENGINE_RESTARTS.inc()
            svc.registry.on_engine_restart()

        svc.engine.on_restart = on_restart

        async def start_engine(client: EngineClient) -> None:
            # The port is open while the model loads: /health says 503 "Loading model" meanwhile,
            # like llama-server.  A model that cannot be loaded stops the server.
            try:
                info = await client.start()
                if client is svc.engine and info.n_slots != svc.registry.n_seqs:
                    svc.registry.set_sequences(info.n_slots)  # a standalone worker's own -np
            except Exception as exc:
                log.error("engine failed to start; shutting down", error=str(exc))
                os.kill(os.getpid(), signal.SIGTERM)

        starting = [asyncio.create_task(start_engine(svc.engine), name="engine-start")]
        if svc.classifier is not None:
            starting.append(asyncio.create_task(start_engine(svc.classifier), name="classifier-start"))
        try:
            yield
        finally:
            for task in starting:
                task.cancel()
            await svc.registry.shutdown()
            if svc.classifier is not None:
                await svc.classifier.close()
            if svc.embedder is not None:
                await svc.embedder.close()
            await svc.engine.close()

    async def before_request(_: Request[Any, Any, Any]) -> None:
        structlog.contextvars.clear_contextvars()

    # llama-server's CORS answer (common/common.h cors_methods, cors_credentials): GET, POST, DELETE, OPTIONS
    cors = CORSConfig(
        allow_origins=list(settings.allowed_origins),
        allow_methods=list(CORS_METHODS),
        allow_headers=["*"],
        allow_credentials=True,
        expose_headers=["*"],
    )
    middleware = [origin_middleware(cors), slot_header_middleware]
    if settings.api_key:
        middleware.append(api_key_middleware(settings.api_key, settings.admin_key))
    prometheus = PrometheusConfig(app_name="slotserve", prefix="slotserve_http", group_path=True)
    route_handlers: list[Any] = [
        ModelController,
        GenerateController,
        binary_stream,
        event_stream,
        health,
        MetricsController,
    ]
    from orchestrator.admin.routes import AdminController
    from orchestrator.api.anthropic.routes import MessagesController
    from orchestrator.api.kobold.routes import KoboldController
    from orchestrator.api.llama_server.chat import LlamaChatController
    from orchestrator.api.llama_server.routes import LlamaServerController
    from orchestrator.api.llama_server.slots import SlotController
    from orchestrator.api.native.classify import classify
    from orchestrator.api.native.preview import PreviewController
    from orchestrator.api.openai.embeddings import EmbeddingsController
    from orchestrator.api.openai.responses import ResponsesController
    from orchestrator.api.openai.routes import OpenAIController

    route_handlers += [
        SlotController,
        PreviewController,
        classify,
        AdminController,
        OpenAIController,
        ResponsesController,
        MessagesController,
        LlamaServerController,
        LlamaChatController,
        EmbeddingsController,
        KoboldController,
    ]
    return Litestar(
        route_handlers=route_handlers,
        lifespan=[lifespan],
        dependencies={
            "services": Provide(provide_services, sync_to_thread=False),
            "ops": Provide(provide_slot_ops, sync_to_thread=False),
        },
        cors_config=cors,
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[*middleware, prometheus.middleware],
        plugins=[
            StructlogPlugin(
                StructlogConfig(
                    # Our handlers log every error once (orchestrator/web/errors.py, ``report``): a refusal
                    # as one info line, a failure with its traceback.
                    structlog_logging_config=StructLoggingConfig(log_exceptions="never"),
                    # Never log bodies (attention, SES1 states, conversations) or query strings (api_key).
                    middleware_logging_config=LoggingMiddlewareConfig(
                        request_log_fields=("path", "method", "content_type", "path_params"),
                        response_log_fields=RESPONSE_LOG_FIELDS,
                    ),
                )
            )
        ],
        before_request=before_request,
        before_send=[preflight_ok, canonical_header_names],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(title="slotserve", version="0.1.0", path="/schema"),
        debug=False,
    )
