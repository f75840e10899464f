"""The long-lived objects a request handler may use, owned by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.datastructures import State

from orchestrator.config import Settings
from orchestrator.engine_api import EngineClient
from orchestrator.generation import GenerationService
from orchestrator.persistence import Persistence
from orchestrator.slots import SlotRegistry


@dataclass
class Services:
    """Engine client, slot registry, generation service, persistence, classifier client and settings."""

    settings: Settings
    engine: EngineClient
    registry: SlotRegistry
    generation: GenerationService
    persistence: Persistence | None = None
    classifier: EngineClient | None = None  # the classifier worker (--classifier-model)


def provide_services(state: State) -> Services:
    """Litestar dependency: the app's :class:`Services`."""
    return state.services  # type: ignore[no-any-return]
