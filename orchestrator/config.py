"""Server settings, declared once: every field with its default, its check and its ``slotserve serve`` flags.

:class:`Settings` is declared as :class:`contract.settings.EngineSettings` is, one line a field
(``Annotated[type, check, Flag(help, *flags)] = default``), and ``slotserve serve``'s own flags
are generated from it by the same functions (:func:`contract.settings.add_arguments` and
:func:`contract.settings.from_args` with ``cls=Settings``); docs/operations.md documents each
flag. The engine's settings ride along in :attr:`Settings.worker`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from contract.flow import WINDOW_BYTES, WINDOW_TOKENS
from contract.settings import EngineSettings, Flag, NonNegative, Positive
from orchestrator.engine_client.launch import WorkerOptions
from orchestrator.web.read_limits import ReadLimits

Codec = Literal["auto", "best", "zstd", "zstd-planes", "none"]
Durability = Literal["strict", "write-behind"]
ReasoningFormat = Literal["none", "auto", "deepseek"]
"""``reasoning_format`` values (llama-server's; ``auto`` is ``deepseek``: thoughts in ``reasoning_content``)."""
_limits = ReadLimits()


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the orchestrator needs to start (see the module docstring; units in the names:
    ``_s`` seconds, ``_ms`` milliseconds, ``_bytes`` bytes).

    ``max_body_bytes`` caps HTTP bodies and WebSocket messages (``PAYLOAD_TOO_LARGE``).
    ``state_dir`` is the embedded store's directory, used when ``redis_url`` is unset.
    ``allowed_origins``: web origins (``https://host:port``) allowed to use the API
    (``orchestrator/web/origins.py``); ``*`` allows any.  ``queue_size`` / ``queue_timeout_s``:
    requests that may wait for a free engine sequence, and for how long; see
    :mod:`orchestrator.slots.admission`.  ``store_timeout_s``: deadline of one state-store call
    (:class:`storage.timeouts.TimeoutStore`).  ``durability``: ``strict`` (a turn is answered once
    its state is stored) or ``write-behind`` (answered at once, stored ``write_delay_ms`` later;
    docs/operations.md).  ``stream_window`` / ``stream_window_bytes``: how far a generation may run
    ahead of what its client has taken, in tokens and in tensor bytes (flow control, :mod:`contract.flow`).
    ``api_keys``, ``tenant_header``, ``gateway_secret``, ``gateway_from`` and the ``tenant_*`` limits:
    docs/operations.md, "Tenants" (:mod:`orchestrator.tenants`).  ``stall_timeout_s``: how long a
    generation's client may take nothing before the generation is stopped and its slot parked
    (:mod:`orchestrator.generation.stall`).
    ``seed``, ``alias``, ``tags`` and ``embeddings`` are
    llama-server's flags of the same names (llama.cpp ``common/arg.cpp``); ``noshift`` is KoboldCpp's
    ``--noshift`` (:data:`orchestrator.api.common.kobold.KOBOLD_CACHE_REUSE`).
    """

    @property
    def model_id(self) -> str | None:
        """The model name the API reports: the first ``--alias`` in sorted order, as llama-server
        takes it from its alias set (``server-context.cpp``); None: the model's own name."""
        return min(self.alias) if self.alias else None

    worker: WorkerOptions = msgspec.field(default_factory=WorkerOptions)
    host: Annotated[str, Flag("where to listen (comma-separated: several addresses)", "--host", metavar="HOST")] = (
        "127.0.0.1"
    )
    port: Annotated[int, msgspec.Meta(ge=0, le=65535), Flag("where to listen", "--port")] = 5001
    api_key: Annotated[
        str | None, Flag("require this key (Bearer, X-Api-Key)", "--api-key", env="SLOTSERVE_API_KEY", metavar="KEY")
    ] = None
    admin_key: Annotated[
        str | None,
        Flag("guards /admin and slot-changing actions", "--admin-key", env="SLOTSERVE_ADMIN_KEY", metavar="KEY"),
    ] = None
    api_keys: Annotated[
        Path | None,
        Flag(
            "keys file: 'KEY TENANT [admin]' per line, KEY may be sha256:<hex>; re-read on SIGHUP",
            "--api-keys",
            env="SLOTSERVE_API_KEYS",
            metavar="FILE",
        ),
    ] = None
    tenant_header: Annotated[
        str | None,
        Flag(
            "header naming the tenant, believed only with --gateway-secret or from --gateway-from",
            "--tenant-header",
            metavar="NAME",
        ),
    ] = None
    gateway_secret: Annotated[
        str | None,
        Flag(
            "shared secret a gateway sends in X-Gateway-Secret with --tenant-header",
            "--gateway-secret",
            env="SLOTSERVE_GATEWAY_SECRET",
            metavar="SECRET",
        ),
    ] = None
    gateway_from: Annotated[
        tuple[str, ...],
        Flag("client addresses or networks (CIDR) --tenant-header is believed from", "--gateway-from", metavar="LIST"),
    ] = ()
    tenant_generations: Annotated[
        int,
        NonNegative,
        Flag("generations one tenant may run at once (0: no limit; over it: 429)", "--tenant-generations"),
    ] = 0
    tenant_resident: Annotated[
        int,
        NonNegative,
        Flag("engine sequences one tenant's slots may hold at once (0: no limit; over it: 429)", "--tenant-resident"),
    ] = 0
    tenant_stored_bytes: Annotated[
        int,
        NonNegative,
        Flag("bytes of stored slot state one tenant may keep (0: no limit; over it: 429)", "--tenant-stored-bytes"),
    ] = 0
    stall_timeout_s: Annotated[
        float,
        msgspec.Meta(ge=0),
        Flag(
            "a generation whose client takes nothing this long is stopped and its slot parked (0: never)",
            "--stall-timeout",
            metavar="S",
        ),
    ] = 30.0
    slots_endpoint: Annotated[bool, Flag("the GET /slots listing (llama-server's --no-slots)", "--slots")] = True
    webui: Annotated[bool, Flag("the chat page at / (llama-server's --no-webui / --no-ui)", "--webui", "--ui")] = True
    max_body_bytes: Annotated[
        int, Positive, Flag("largest JSON body / WebSocket message, bytes", "--max-body", metavar="BYTES")
    ] = 64 << 20
    max_header_bytes: Annotated[
        int, Positive, Flag("largest request line + headers, bytes (431)", "--max-header-bytes", metavar="BYTES")
    ] = _limits.max_header_bytes
    header_timeout_s: Annotated[
        float, msgspec.Meta(gt=0), Flag("seconds a request's headers may take (408)", "--header-timeout", metavar="S")
    ] = _limits.header_timeout_s
    body_timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0),
        Flag("longest pause within a request body, seconds (408)", "--body-timeout", metavar="S"),
    ] = _limits.body_timeout_s
    allowed_origins: Annotated[
        tuple[str, ...],
        Flag(
            "web origins allowed to call the API, HTTP (CORS) and WebSocket alike; comma-separated or repeated"
            " (*: any page)",
            "--allowed-origins",
            "--cors-origin",
            metavar="LIST",
        ),
    ] = ("*",)
    slot_save_path: Annotated[
        Path | None, Flag("directory of the save/restore file actions", "--slot-save-path", metavar="DIR")
    ] = None
    state_dir: Annotated[
        Path | None,
        Flag("embedded store directory", "--state-dir", default_text="~/.local/state/slotserve", metavar="DIR"),
    ] = None
    redis_url: Annotated[
        str | None,
        Flag(
            "redis://, rediss://, sentinel, cluster, file://", "--redis-url", env="SLOTSERVE_REDIS_URL", metavar="URL"
        ),
    ] = None
    key_prefix: Annotated[str, Flag("store key prefix", "--key-prefix", metavar="P")] = "slotserve:"
    state_ttl_s: Annotated[int | None, Flag("expire stored slots N seconds after their last save", "--state-ttl")] = (
        None
    )
    chunk_bytes: Annotated[
        int, Positive, Flag("split stored blobs into chunks of this size, bytes", "--chunk-bytes")
    ] = 64 << 20
    codec: Annotated[Codec, Flag("state compression", "--codec")] = "auto"
    codec_level: Annotated[int, Flag("zstd level", "--codec-level")] = 3
    persist: Annotated[bool, Flag("a store (--no-persist: slots live only in the engine)", "--persist")] = True
    node_id: Annotated[
        str, Flag("this node's name in slot leases", "--node-id", default_text="host:port", metavar="NAME")
    ] = ""
    lease_ms: Annotated[
        int, Positive, Flag("slot lease time-to-live, ms (renewed every third)", "--lease-ms", metavar="MS")
    ] = 6_000
    park_idle_s: Annotated[
        float, msgspec.Meta(ge=0), Flag("park slots idle this many seconds (0: never)", "--park-idle", metavar="S")
    ] = 600.0
    n_predict: Annotated[
        int,
        msgspec.Meta(ge=-1),
        Flag("tokens a /completion generates without n_predict (-1: to the window)", "--n-predict", "-n"),
    ] = -1
    slot_wait_s: Annotated[
        float,
        msgspec.Meta(ge=0),
        Flag("seconds a request waits for a busy slot (then SLOT_BUSY)", "--slot-wait", metavar="S"),
    ] = 300.0
    noshift: Annotated[
        bool,
        Flag(
            "KoboldCpp's --noshift: KoboldCpp's routes (/api/v1/generate, /api/extra/generate/stream) no longer "
            "reuse the cache of a context pruned in its middle when a request leaves n_cache_reuse out; they "
            "re-prefill from the first removed token, as the other APIs do (docs/api.md, Cache reuse)",
            "--noshift",
        ),
    ] = False
    slot_prompt_similarity: Annotated[
        float,
        msgspec.Meta(ge=0, le=1),
        Flag(
            "a request naming no slot uses the slot whose tokens share more than this fraction of its prompt as"
            " a prefix (llama-server's; 0: off, such requests use slot 0)",
            "--slot-prompt-similarity",
            "-sps",
            metavar="F",
        ),
    ] = 0.1
    anon_slots: Annotated[
        int,
        Positive,
        Flag(
            "anonymous slots (of requests naming no slot) this node keeps; the least recently used idle one is"
            " deleted for a new one",
            "--anon-slots",
        ),
    ] = 64
    queue_size: Annotated[
        int, NonNegative, Flag("requests that may wait for a free engine sequence (0: 429 at once)", "--queue-size")
    ] = 64
    queue_timeout_s: Annotated[
        float, msgspec.Meta(ge=0), Flag("longest wait for an engine sequence, seconds", "--queue-timeout", metavar="S")
    ] = 300.0
    store_timeout_s: Annotated[
        float, msgspec.Meta(gt=0), Flag("deadline of one state-store call, seconds", "--store-timeout", metavar="S")
    ] = 3.0
    durability: Annotated[
        Durability,
        Flag(
            "strict: a turn is answered once its state is stored; write-behind: answered at once, stored after"
            " --write-delay-ms (a crash loses the turns of that window)",
            "--durability",
            metavar="strict|write-behind",
        ),
    ] = "strict"
    write_delay_ms: Annotated[
        int, NonNegative, Flag("write-behind: wait this long to coalesce saves, ms", "--write-delay-ms", metavar="MS")
    ] = 200
    stream_window: Annotated[
        int,
        Positive,
        Flag("tokens a generation may run ahead of what its client has taken", "--stream-window", metavar="N"),
    ] = WINDOW_TOKENS
    stream_window_bytes: Annotated[
        int,
        NonNegative,
        Flag(
            "bytes of attention and hidden states a generation may run ahead of its client (0: no byte bound;"
            " one token always goes)",
            "--stream-window-bytes",
            metavar="BYTES",
        ),
    ] = WINDOW_BYTES
    stream_shm_bytes: Annotated[
        int,
        NonNegative,
        Flag(
            "size of a shared memory region tokens' attention and hidden states travel through from the engine"
            " worker (0, the default: none, over the worker's socket; a region needs --stream-window-bytes x the"
            " engine's sequences, at least 64 MiB)",
            "--stream-shm-bytes",
            metavar="BYTES",
        ),
    ] = 0
    classifier_model: Annotated[
        str | None,
        Flag("classifier GGUF (pooling rank) served by POST /classify", "--classifier-model", metavar="PATH"),
    ] = None
    log_level: Annotated[str, Flag("uvicorn log level", "--log-level", metavar="L")] = "info"
    seed: Annotated[
        int,
        msgspec.Meta(ge=-1, le=2**32 - 1),
        Flag("sampling seed of requests that give none (-1: random; llama-server's --seed)", "--seed", "-s"),
    ] = -1
    alias: Annotated[
        tuple[str, ...],
        Flag(
            "model names the API reports, comma-separated (the first in sorted order is the id;"
            " llama-server's --alias)",
            "--alias",
            "-a",
            metavar="LIST",
        ),
    ] = ()
    tags: Annotated[
        tuple[str, ...], Flag("model tags /v1/models reports, comma-separated (llama-server's --tags)", "--tags")
    ] = ()
    embeddings: Annotated[
        bool,
        Flag(
            "serve POST /v1/embeddings (a second, pooled context of the model; llama-server's --embeddings)",
            "--embeddings",
        ),
    ] = True
    embeddings_keep_alive: Annotated[
        float,
        msgspec.Meta(ge=0),
        Flag(
            "seconds the embeddings worker stays started after its last request (Ollama's keep_alive; 0: "
            "until the server stops)",
            "--embeddings-keep-alive",
            metavar="SECONDS",
        ),
    ] = 300.0
    reasoning_format: Annotated[
        ReasoningFormat,
        Flag(
            "llama-server's --reasoning-format: a thinking template's thoughts in reasoning_content (auto, "
            "deepseek) or left in content (none); a request's reasoning_format overrides it",
            "--reasoning-format",
            metavar="none|auto|deepseek",
        ),
    ] = "auto"
    reasoning_budget: Annotated[
        int,
        msgspec.Meta(ge=-1, le=2**31 - 1),
        Flag(
            "llama-server's --reasoning-budget: tokens a thought may take before its end is forced (-1: no "
            "limit, 0: ended at once); a request's thinking_budget_tokens overrides it",
            "--reasoning-budget",
        ),
    ] = -1
    reasoning_budget_message: Annotated[
        str,
        Flag(
            "llama-server's --reasoning-budget-message: text forced before the end-of-thinking tag when the "
            "budget is spent",
            "--reasoning-budget-message",
            metavar="MESSAGE",
        ),
    ] = ""

    @property
    def read_limits(self) -> ReadLimits:
        """How a request may arrive (uvicorn's protocol, :mod:`orchestrator.web.read_limits`)."""
        return ReadLimits(self.max_header_bytes, self.header_timeout_s, self.body_timeout_s)

    @property
    def engine_worker(self) -> WorkerOptions:
        """The generation worker's options with its shared region's size (``stream_shm_bytes``; 0: none).
        Off by default: on the project's 2-core VM the region measured slower than the socket (docs/benchmarks.md,
        "Shared memory"); docs/operations.md says the size a region needs."""
        return dataclasses.replace(self.worker, shm_bytes=self.stream_shm_bytes)

    @property
    def embedder(self) -> WorkerOptions | None:
        """The embeddings worker's options (``--embeddings``): the served model pooled, with the
        first worker's threads and repacking."""
        if not self.embeddings:
            return None
        engine = self.worker.engine
        return WorkerOptions(
            EngineSettings(model=engine.model, n_threads=engine.n_threads, repack=engine.repack, embedder=True),
            shm_bytes=0,
        )

    @property
    def classifier(self) -> WorkerOptions | None:
        """The second worker's options with ``--classifier-model`` (the first's threads and repacking)."""
        if self.classifier_model is None:
            return None
        engine = self.worker.engine
        return WorkerOptions(
            EngineSettings(
                model=self.classifier_model, n_threads=engine.n_threads, repack=engine.repack, classifier=True
            ),
            shm_bytes=0,
        )
