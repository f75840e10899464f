"""A slot: one conversation's KV state and its bookkeeping, as the registry keeps it.

Only :class:`orchestrator.slots.registry.SlotRegistry` writes these fields; everything else
(generation, slot actions, the HTTP layer, the admin view) reads them and reports
what happened through the registry's methods.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field

from contract.errors import ErrorCode
from contract.options import SamplingParams
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import WaitHooks
from orchestrator.tenants.principal import DEFAULT_TENANT

MAX_SLOT_ID = 256


@dataclass(eq=False)
class Slot:
    """One conversation's state (read-only outside the registry).

    ``seq`` is the engine sequence it holds (None: parked or empty), valid while
    ``engine_generation`` equals the engine client's ``generation``.  ``n_tokens`` counts
    the tokens of its KV state (live during a generation).  ``stored``: the store holds a
    copy; ``dirty``: that copy is older than the engine's.  ``stored_bytes`` /
    ``raw_bytes``: compressed and SES1 sizes of the stored copy (bytes).  ``requests``:
    client requests holding or waiting for ``lock`` (background saves do not count).
    ``synced``: the stored version this node's knowledge of the slot comes from, as
    ``(generation, digest)`` of its metadata (``(0, "")``: nothing stored; None: unknown, the
    store must be asked before the slot is used).  ``tenant``: the slot's owner; ids are per
    tenant, and :attr:`key` (``tenant/id``) names the slot in the registry, the store and leases.
    """

    id: str
    tenant: str = DEFAULT_TENANT
    partition: str = ""  # the cache partition in the tenant: :func:`partition_of` its requests' cache_salt
    seq: int | None = None
    n_tokens: int = 0
    engine_generation: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stored: bool = False
    dirty: bool = False
    stored_bytes: int = 0
    raw_bytes: int = 0
    n_prompt_tokens_processed: int = 0
    # the last generation on this slot, for llama-server's GET /slots (id_task, params, next_token)
    id_task: int = -1
    params: SamplingParams | None = None
    n_decoded: int = 0
    n_prompt_tokens_cache: int = 0
    requests: int = 0
    holder_hooks: WaitHooks | None = None  # the holding request's (its client's departure ends its waits)
    synced: tuple[int, str] | None = None
    keep_alive_s: float | None = None  # park once idle this long (Ollama's keep_alive; inf: never; None: --park-idle)

    @property
    def key(self) -> str:
        """The slot's name across tenants: :func:`slot_key` of its tenant and id."""
        return slot_key(self.tenant, self.id)

    @property
    def busy(self) -> bool:
        """True while a client request uses the slot (``is_processing``)."""
        return self.requests > 0

    @property
    def place(self) -> str:
        """``resident`` (holds an engine sequence), ``parked`` (store only) or ``empty``."""
        if self.seq is not None:
            return "resident"
        return "parked" if self.stored else "empty"


def check_slot_id(slot_id: str) -> str:
    """Validate a slot id (1..256 printable characters); raise ``INVALID_REQUEST``."""
    if not slot_id or len(slot_id) > MAX_SLOT_ID or not slot_id.isprintable():
        raise ServiceError(
            ErrorCode.INVALID_REQUEST, f"bad slot id {slot_id[:40]!r}: 1..{MAX_SLOT_ID} printable characters"
        )
    return slot_id


def partition_of(cache_salt: str | None) -> str:
    """The cache partition of requests sending ``cache_salt`` (vLLM's field): ``""`` without one, else a
    SHA-256 digest (32 hex digits), so the salt itself is never stored.  Caches are reused only within
    one tenant and one partition."""
    if not cache_salt:
        return ""
    return hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:32]


def slot_key(tenant: str, slot_id: str) -> str:
    """A slot's key in the registry, the store (Redis keys, directory names) and leases:
    ``tenant/slot_id``, or the bare id for the default tenant's ids without ``/`` (so a server
    without keys keeps the keys it always had).  A tenant name holds no ``/``
    (:class:`orchestrator.tenants.principal.Principal`), so keys of different tenants never meet:
    a key without ``/`` is the default tenant's, any other is split at its first ``/``."""
    if tenant == DEFAULT_TENANT and "/" not in slot_id:
        return slot_id
    return f"{tenant}/{slot_id}"


def split_key(key: str) -> tuple[str, str]:
    """``(tenant, slot_id)`` of a :func:`slot_key`."""
    tenant, sep, slot_id = key.partition("/")
    return (tenant, slot_id) if sep else (DEFAULT_TENANT, key)


def slot_id_out(slot_id: str) -> int | str:
    """A slot id as clients read it: a numeric id as an integer (llama-server's ``id_slot``), others as
    they are."""
    return int(slot_id) if slot_id.isdigit() and len(slot_id) < 10 else slot_id
