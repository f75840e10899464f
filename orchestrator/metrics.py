"""Prometheus metrics (prometheus-client, served at ``/metrics`` by Litestar's PrometheusController)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from contract.protocol import Done
from orchestrator.llama_metrics import LLAMA_SERVER

TOKENS_GENERATED = Counter("slotserve_tokens_generated_total", "Tokens generated")
PROMPT_TOKENS = Counter("slotserve_prompt_tokens_total", "Prompt tokens prefilled (not served from the KV cache)")
CACHED_TOKENS = Counter("slotserve_prompt_tokens_cached_total", "Prompt tokens served from a slot's KV cache")
GENERATIONS = Counter("slotserve_generations_total", "Finished generations", ["finish_reason"])
GENERATION_SECONDS = Histogram("slotserve_generation_seconds", "Wall time of a generation")
SAVES = Counter("slotserve_slot_saves_total", "Slot states written to the store (parking and write-behind)", ["tenant"])
RESTORES = Counter("slotserve_slot_restores_total", "Slots restored from the store", ["tenant"])
STALE_WRITES_REFUSED = Counter(
    "slotserve_stale_writes_refused_total",
    "Slot state writes refused because this node no longer held the slot's lease (its copy was dropped)",
)
DURABLE_COMMIT_SECONDS = Histogram(
    "slotserve_durable_commit_seconds",
    "Time a turn's answer waited for its state to be stored (--durability strict)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ENGINE_RESTARTS = Counter("slotserve_engine_restarts_total", "Engine worker restarts")
QUEUE_WAIT_SECONDS = Histogram(
    "slotserve_queue_wait_seconds",
    "Time requests waited in the admission queue for an engine sequence (granted ones)",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
QUEUE_REFUSED = Counter("slotserve_queue_refused_total", "Requests refused by the admission queue", ["reason"])


def record_generation(done: Done) -> None:
    """Count a finished generation (slotserve's metrics and llama-server's ``llamacpp:*``)."""
    LLAMA_SERVER.record(done)
    TOKENS_GENERATED.inc(done.n_generated)
    PROMPT_TOKENS.inc(done.n_prefilled)
    CACHED_TOKENS.inc(done.n_cached)
    GENERATIONS.labels(done.finish_reason).inc()
    GENERATION_SECONDS.observe((done.t_prefill_ms + done.t_generate_ms) / 1000)


def record_abandoned(n_generated: int) -> None:
    """Count a generation whose client left (or whose worker died) before its end."""
    TOKENS_GENERATED.inc(n_generated)
    LLAMA_SERVER.record_abandoned(n_generated)
    GENERATIONS.labels("abandoned").inc()
