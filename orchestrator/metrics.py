"""Prometheus metrics (prometheus-client, served at ``/metrics`` by Litestar's PrometheusController)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TOKENS_GENERATED = Counter("slotserve_tokens_generated_total", "Tokens generated")
PROMPT_TOKENS = Counter("slotserve_prompt_tokens_total", "Prompt tokens prefilled (not served from the KV cache)")
CACHED_TOKENS = Counter("slotserve_prompt_tokens_cached_total", "Prompt tokens served from a slot's KV cache")
GENERATIONS = Counter("slotserve_generations_total", "Finished generations", ["finish_reason"])
GENERATION_SECONDS = Histogram("slotserve_generation_seconds", "Wall time of a generation")
SLOTS = Gauge("slotserve_slots", "Known slots by place", ["place"])
PARKS = Counter("slotserve_slot_parks_total", "Slots parked to the store")
RESTORES = Counter("slotserve_slot_restores_total", "Slots restored from the store")
ENGINE_RESTARTS = Counter("slotserve_engine_restarts_total", "Engine worker restarts")
