"""Server settings (the ``slotserve serve`` command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.worker_options import WorkerOptions


@dataclass(frozen=True)
class Settings:
    """Everything the orchestrator needs to start.

    ``max_body_bytes`` caps HTTP bodies and WebSocket messages (``PAYLOAD_TOO_LARGE``).
    ``state_dir`` is the embedded store's directory, used when ``redis_url`` is unset.
    ``allowed_origins``: web origins (``https://host:port``) allowed to use the API, by CORS
    on HTTP and by the ``Origin`` header of a WebSocket handshake; ``*`` allows any.
    ``queue_size`` / ``queue_timeout_s``: requests that may wait for a free engine sequence,
    and for how long (seconds); see :mod:`orchestrator.admission`.  ``store_timeout_s``:
    deadline of one state-store call (seconds; :class:`storage.timeouts.TimeoutStore`).
    ``durability``: ``strict`` (a turn is answered once its state is stored) or
    ``write-behind`` (answered at once, stored ``write_delay_ms`` later; docs/operations.md).
    """

    worker: WorkerOptions = field(default_factory=WorkerOptions)
    host: str = "127.0.0.1"
    port: int = 5001
    api_key: str | None = None
    admin_key: str | None = None  # guards /admin and every slot-changing action
    slots_endpoint: bool = True  # GET /slots (llama-server's --no-slots turns it off)
    max_body_bytes: int = 64 << 20
    allowed_origins: tuple[str, ...] = ("*",)
    slot_save_path: Path | None = None
    state_dir: Path | None = None
    redis_url: str | None = None
    key_prefix: str = "slotserve:"
    state_ttl_s: int | None = None
    chunk_bytes: int = 64 << 20
    codec: str = "auto"
    codec_level: int = 3
    persist: bool = True
    node_id: str = ""
    lease_ms: int = 6_000
    park_idle_s: float = 600.0
    n_predict: int = -1  # llama-server's -n: tokens a /completion generates without n_predict (-1: to the window)
    slot_wait_s: float = 300.0  # longest wait for a busy slot (KoboldCpp/OpenAI clients queue)
    classifier: WorkerOptions | None = None  # a second worker serving a classifier GGUF
    queue_size: int = 64
    queue_timeout_s: float = 300.0
    store_timeout_s: float = 3.0
    durability: str = "strict"
    write_delay_ms: int = 200
