"""Prometheus metrics (prometheus-client, served at ``/metrics`` by Litestar's PrometheusController)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
STATE_BYTES_WRITTEN = Counter(
    "slotserve_state_bytes_written_total",
    "Bytes of incremental slot states written to the store (new KV chunks and the stored metadata's blob)",
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

# Per tenant (docs/operations.md, "Tenants"): a tenant's name is its label value.
TENANT_WAITING = Gauge(
    "slotserve_tenant_queue_waiting", "Requests of a tenant waiting for an engine sequence", ["tenant"]
)
TENANT_GENERATIONS_ACTIVE = Gauge("slotserve_tenant_generations_active", "Generations a tenant runs now", ["tenant"])
TENANT_GENERATIONS = Counter("slotserve_tenant_generations_total", "Generations a tenant ran to their end", ["tenant"])
TENANT_TOKENS = Counter("slotserve_tenant_tokens_generated_total", "Tokens generated for a tenant", ["tenant"])
TENANT_PROMPT_TOKENS = Counter(
    "slotserve_tenant_prompt_tokens_total", "Prompt tokens prefilled for a tenant (not from its KV cache)", ["tenant"]
)
TENANT_STORED_BYTES = Gauge(
    "slotserve_tenant_stored_bytes", "Bytes of stored slot state of a tenant's slots this node knows", ["tenant"]
)
TENANT_REFUSED = Counter(
    "slotserve_tenant_refused_total", "Requests of a tenant refused by a per-tenant limit", ["tenant", "limit"]
)
STALLED = Counter(
    "slotserve_stalled_generations_total",
    "Generations stopped and parked because their client took nothing for --stall-timeout",
    ["tenant"],
)


def record_generation(done: Done, tenant: str | None = None) -> None:
    """Count a finished generation (slotserve's metrics and llama-server's ``llamacpp:*``; per
    ``tenant`` too when given)."""
    if tenant is not None:
        TENANT_GENERATIONS.labels(tenant).inc()
        TENANT_TOKENS.labels(tenant).inc(done.n_generated)
        TENANT_PROMPT_TOKENS.labels(tenant).inc(done.n_prefilled)
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
