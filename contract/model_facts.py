"""Facts about the loaded model and the engine configuration in force, as the worker reports
them in its ``Ready`` message (:mod:`contract.protocol`) and the API serves them
(``GET /api/v1/model``, ``/health``; docs/api.md).  Built by :mod:`engine.model_info`."""

from __future__ import annotations

import msgspec
import numpy as np


class EngineRuntime(msgspec.Struct, kw_only=True):
    """The engine configuration in force (``/health``, ``GET /api/v1/model``'s ``engine``).

    ``devices``: ggml backend devices as ``NAME (description)``; ``backend``: the device
    type layers run on (``CPU``, ``GPU``); ``extra_bufts``: the CPU backend's extra buffer
    types on this host and ``use_extra_bufts`` whether the model uses them (llama-server's
    ``--no-repack`` is False), with ``repack_reason``; ``flash_attn``: whether llama.cpp computes
    attention with flash attention, with ``flash_attn_reason`` (what ``--flash-attn auto`` chose here:
    :func:`engine.backend.choose_flash_attn`); ``kv_unified``: one KV
    stream for every sequence (False: one per sequence); ``context_shift``: ``--context-shift`` is on
    and the model's memory can shift (a full generation shifts its window instead of ending);
    ``capture``: how attention rows are produced (``graph``: as outputs of llama.cpp's graph, libllama/
    in this repository; ``off``); ``capture_stable_graph``: whether decodes with and without attention
    build one graph shape (``llama_attn_set_stable``; on where layers run on a GPU); ``cuda_graphs``:
    whether llama.cpp's CUDA backend runs the decode graphs as CUDA graphs (built with them and not
    disabled by ``GGML_CUDA_DISABLE_GRAPHS``), ``None`` where no layer runs on a CUDA device (docs/gpu.md);
    ``system_info``: llama.cpp's ``llama_print_system_info`` line.
    """

    backend: str
    devices: list[str]
    n_gpu_layers: int
    n_layers_offloaded: int
    extra_bufts: list[str]
    use_extra_bufts: bool
    repack_reason: str
    flash_attn: bool
    flash_attn_reason: str = ""
    type_k: str
    type_v: str
    kv_unified: bool
    context_shift: bool = False
    n_threads: int
    n_seq_max: int
    capture: str
    capture_stable_graph: bool = False
    cuda_graphs: bool | None = None
    self_check_ms: float
    system_info: str


class MemoryInfo(msgspec.Struct, kw_only=True):
    """What the model keeps per sequence (``GET /api/v1/model``'s ``memory``; docs/models.md).

    ``type``: ``kv`` (one KV cache), ``iswa`` (a KV cache for the global layers and one for the
    sliding-window layers, llama.cpp's ``llama_kv_cache_iswa``), ``hybrid`` (KV cache and a recurrent
    state per sequence) or ``recurrent`` (a recurrent state only); ``kv_caches``: how many KV caches
    a sequence state holds; ``sliding_window``: tokens a sliding-window layer attends back over (0:
    none); ``context_shift`` and ``partial_reuse``: whether ``context-shift`` and reusing a prefix of
    a cached sequence (cutting it at an earlier position) are possible.
    """

    type: str = "kv"
    kv_caches: int = 1
    sliding_window: int = 0
    context_shift: bool = True
    partial_reuse: bool = True


SINK_ARCHITECTURES = frozenset({"gpt-oss", "mimo2", "granite_swa", "hy_v4", "deepseek4", "dflash"})
"""``general.architecture`` of the models llama.cpp gives attention sinks (the ``src/models/*.cpp`` that load
``LLM_TENSOR_ATTN_SINKS``): their rows sum to less than 1."""


def attention_rows_sum_ok(sums: np.ndarray, sinks: bool) -> bool:
    """Whether attention row sums ``sums`` (any shape, float) are a softmax's: 1 each (within 1e-3), or on a model
    with attention sinks (llama.cpp's ``ggml_soft_max_add_sinks``: the sink's logit joins the softmax and its
    weight is dropped) each in (0, 1]."""
    if sinks:
        return bool(np.all((sums > 0) & (sums <= 1.0 + 1e-3)))
    return bool(np.allclose(sums, 1.0, atol=1e-3))


class ModelFacts(msgspec.Struct, kw_only=True):
    """The GGUF's facts under llama.cpp's names, shared by the worker's report (:class:`ModelInfo`) and the
    API's ``GET /api/v1/model`` answer, which adds the seeds' aliases (docs/api.md, "Model").

    ``attention_layers``: the layers with attention rows (a recurrent layer has none); ``attention_windows``: per
    attention layer its sliding window in tokens, 0 for a global one; ``n_kv_cells``: cells per KV stream;
    ``attention_sinks``: the architecture has learned attention sinks (:data:`SINK_ARCHITECTURES`), so a head's
    row sums to less than 1 (the sink takes the rest)."""

    model_name: str
    model_path: str
    architecture: str
    description: str
    fingerprint: str
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    n_kv_cells: int
    n_slots: int
    attention_layers: list[int]
    attention_windows: list[int] = []
    attention_sinks: bool = False
    rope_freq_base: float
    rope_freq_scale: float
    bos_token_id: int
    eos_token_id: int
    eot_token_id: int
    eog_token_ids: list[int]
    special_tokens: dict[str, str | int]
    chat_template: str
    n_params: int
    size_bytes: int


class ModelInfo(ModelFacts, kw_only=True):
    """Model and engine facts as the worker reports them: :class:`ModelFacts` and the context (``n_ctx`` per
    sequence, ``n_ctx_train``), the memory, the runtime and the llama-cpp-python version."""

    n_ctx: int
    n_ctx_train: int
    memory: MemoryInfo = msgspec.field(default_factory=MemoryInfo)
    llama_cpp_version: str
    runtime: EngineRuntime
    classifier_labels: list[str] = []  # a classifier's output labels, in logit order
