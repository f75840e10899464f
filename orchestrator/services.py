"""The long-lived objects a request handler may use, owned by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field

from litestar.datastructures import State

from orchestrator.config import Settings
from orchestrator.engine_client.interface import EngineClient
from orchestrator.engine_client.lazy import LazyWorker
from orchestrator.generation.feed import AttentionFeed
from orchestrator.generation.service import GenerationService
from orchestrator.slots.operations import SlotOps
from orchestrator.slots.persistence import SlotArchive
from orchestrator.slots.registry import SlotRegistry


@dataclass
class Services:
    """Engine client, slot registry, generation service, slot archive (the store), classifier client, the admin
    page's attention feed and settings."""

    settings: Settings
    engine: EngineClient
    registry: SlotRegistry
    generation: GenerationService
    archive: SlotArchive | None = None  # the state store (None: --no-persist)
    classifier: EngineClient | None = None  # the classifier worker (--classifier-model)
    feed: AttentionFeed = field(default_factory=AttentionFeed)  # the admin page's live view of generated tokens
    embedder: LazyWorker | None = None  # the embeddings worker (--embeddings), started on first use

    @property
    def model_id(self) -> str:
        """The model's name in API responses: ``--alias`` (:attr:`Settings.model_id`) or the model's own."""
        return self.settings.model_id or self.generation.info.model_name


def provide_services(state: State) -> Services:
    """Litestar dependency: the app's :class:`Services`."""
    return state.services  # type: ignore[no-any-return]


def provide_slot_ops(services: Services) -> SlotOps:
    """Litestar dependency: the slot actions (:class:`SlotOps`) over the app's registry."""
    settings = services.settings
    return SlotOps(services.registry, settings.slot_save_path, worker_files=settings.worker.shares_files)
