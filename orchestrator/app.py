"""The Litestar application: routes, CORS, errors, logging, metrics, and the lifespan
that owns the engine worker, the slot registry and the state store."""

from __future__ import annotations

import asyncio
import contextlib
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
from orchestrator.tenants.gateway import TenantHeader, parse_networks
from orchestrator.tenants.keys import KeyRing
from orchestrator.tenants.limits import TenantLimits
from orchestrator.web.access_log import StreamLoggingMiddleware
from orchestrator.web.auth import Authenticator, auth_middleware
from orchestrator.web.errors import EXCEPTION_HANDLERS, ApiError
from orchestrator.web.header_case import canonical_header_names
from orchestrator.web.origins import CORS_METHODS, origin_middleware, preflight_ok
from orchestrator.web.slot_header import slot_header_middleware

log = structlog.get_logger("slotserve")

# Never log bodies (attention, SES1 states, conversations) or query strings (api_key).
RESPONSE_LOG_FIELDS: tuple[ResponseExtractorField, ...] = ("status_code",)


def build_services(settings: Settings) -> Services:
    """Create (not start) the long-lived objects."""
    engine = WorkerClient(
        settings.engine_worker, window=settings.stream_window, window_bytes=settings.stream_window_bytes
    )
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
    limits = TenantLimits(settings.tenant_generations, settings.tenant_resident, settings.tenant_stored_bytes)
    generation.limits = registry.residency.limits = limits
    generation.stall_timeout_s = settings.stall_timeout_s
    LLAMA_SERVER.n_batch = settings.worker.engine.n_batch  # llama-server's n_decode_total counts prefill chunks
    embedder = LazyWorker(settings.embedder, settings.embeddings_keep_alive) if settings.embedder is not None else None
    return Services(settings, engine, registry, generation, archive, classifier, feed, embedder)


def build_authenticator(settings: Settings) -> Authenticator:
    """The authenticator of ``settings`` (``--api-key``, ``--admin-key``, ``--api-keys``,
    ``--tenant-header``, ``--gateway-secret``, ``--gateway-from``).  Raises ``ValueError``
    (:class:`orchestrator.tenants.keys.KeysFileError` for the keys file) with a message for the operator."""
    keys = KeyRing(settings.api_key, settings.admin_key, settings.api_keys)
    header = None
    if settings.tenant_header:
        networks = parse_networks(settings.gateway_from)
        if not settings.gateway_secret and not networks:
            raise ValueError("--tenant-header needs --gateway-secret or --gateway-from (whom to believe it from)")
        header = TenantHeader(settings.tenant_header, settings.gateway_secret, networks)
    return Authenticator(keys, header)


def create_app(settings: Settings, services: Services | None = None, auth: Authenticator | None = None) -> Litestar:
    """The slotserve ASGI app for ``settings`` (``services`` injectable for tests; ``auth``: who a
    request acts for, built from ``settings`` when not given: ``ValueError`` for a bad keys file)."""
    svc = services or build_services(settings)
    auth = auth or build_authenticator(settings)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.services = svc
        await svc.registry.start()

        async def on_restart() -> None:
            metrics.ENGINE_RESTARTS.inc()
            svc.registry.residency.on_engine_restart()

        svc.engine.on_restart = on_restart
        loop = asyncio.get_running_loop()
        if auth.keys.keys_file is not None:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                loop.add_signal_handler(signal.SIGHUP, auth.keys.reload)  # re-read --api-keys

        async def start_engine(client: EngineClient) -> None:
            # The port is open while the model loads: /health says 503 "Loading model" meanwhile,
            # like llama-server.  A model that cannot be loaded stops the server.
            try:
                info = await client.start()
                if client is svc.engine and info.n_slots != svc.registry.n_seqs:
                    svc.registry.residency.set_sequences(info.n_slots)  # a standalone worker's own -np
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
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.remove_signal_handler(signal.SIGHUP)

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
    middleware = [origin_middleware(cors), slot_header_middleware, auth_middleware(auth)]
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
    from orchestrator.api.ollama.routes import OllamaController
    from orchestrator.api.openai.completions import CompletionsController
    from orchestrator.api.openai.embeddings import EmbeddingsController
    from orchestrator.api.openai.responses.routes import ResponsesController
    from orchestrator.api.openai.routes import OpenAIController

    route_handlers += [
        SlotController,
        PreviewController,
        classify,
        AdminController,
        OpenAIController,
        CompletionsController,
        ResponsesController,
        MessagesController,
        LlamaServerController,
        LlamaChatController,
        EmbeddingsController,
        KoboldController,
        OllamaController,
    ]
    if settings.webui:
        from orchestrator.webui.routes import webui_handlers

        route_handlers += webui_handlers()
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
                        middleware_class=StreamLoggingMiddleware,  # one line per stream, not per chunk
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
