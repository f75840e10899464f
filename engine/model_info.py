"""What the worker tells the orchestrator about its model and context (``GET /api/v1/model``)."""

from __future__ import annotations

import ctypes

import llama_cpp as llama

from contract.model_facts import SINK_ARCHITECTURES, EngineRuntime, MemoryInfo, ModelInfo
from engine import backend, native
from engine.engine import Engine
from engine.native import lib as libggml

libggml.ggml_type_name.argtypes = [ctypes.c_int]
libggml.ggml_type_name.restype = ctypes.c_char_p


def memory_info(engine: Engine) -> MemoryInfo:
    """What ``engine``'s model keeps per sequence (:class:`engine.memory.Memory`)."""
    mem = engine.memory
    return MemoryInfo(
        type=mem.kind,
        kv_caches=mem.shape.n_caches,
        sliding_window=engine.n_swa,
        context_shift=engine.can_shift,
        partial_reuse=not mem.shape.recurrent,
    )


def cuda_graphs(ctx: int, n_layers_offloaded: int) -> bool | None:
    """Whether the context's CUDA devices run graphs as CUDA graphs (``llama_attn_cuda_graphs``,
    libllama/llama-attn.h); ``None`` when no layer is offloaded or the model uses no CUDA device."""
    found = int(native.lib.llama_attn_cuda_graphs(ctx))
    return None if found < 0 or n_layers_offloaded == 0 else bool(found)


def runtime_info(engine: Engine) -> EngineRuntime:
    """The configuration the engine runs in: devices, offloaded layers, repacking, KV types, threads.

    Layers offloaded follow llama.cpp's rule (``src/llama-model.cpp``): the last
    ``n_gpu_layers`` repeating layers, plus the output layer when ``n_gpu_layers``
    exceeds the layer count; none without a GPU device.
    """
    m, c = engine.model, engine.config
    devs = backend.devices()
    gpus = [d for d in devs if d.type in ("GPU", "IGPU")]
    offloaded = min(c.n_gpu_layers, m.n_layer + 1) if gpus and c.n_gpu_layers > 0 else 0
    return EngineRuntime(
        backend=gpus[0].name if offloaded else "CPU",
        devices=[f"{d.name} ({d.description})" for d in devs],
        n_gpu_layers=c.n_gpu_layers,
        n_layers_offloaded=offloaded,
        extra_bufts=backend.cpu_extra_bufts(),
        use_extra_bufts=m.repack.use_extra_bufts,
        repack_reason=m.repack.reason,
        flash_attn=engine.flash_attn,
        flash_attn_reason=engine.flash_choice.reason,
        type_k=libggml.ggml_type_name(engine.type_k).decode(),
        type_v=libggml.ggml_type_name(engine.type_v).decode(),
        kv_unified=False,
        context_shift=c.context_shift and engine.can_shift,
        n_threads=c.n_threads,
        n_seq_max=c.n_seq_max,
        capture="graph" if engine.capture is not None else "off",
        capture_stable_graph=engine.capture is not None and engine.capture.stable,
        cuda_graphs=cuda_graphs(engine.ctx, offloaded),
        self_check_ms=round(engine.self_check_ms, 1),
        system_info=llama.llama_print_system_info().decode("utf-8", "replace").strip(),
    )


def model_info(engine: Engine) -> ModelInfo:
    """Model facts for ``GET /api/v1/model`` (the fields docs/api.md lists), sent in the worker's ``Ready``."""
    m = engine.model
    name = m.meta("general.name") or m.path.stem
    special = {
        "bos_token": m.pieces[m.bos].decode("utf-8", "replace") if m.bos >= 0 else "",
        "eos_token": m.pieces[m.eos].decode("utf-8", "replace") if m.eos >= 0 else "",
    }
    for text in ("<|im_start|>", "<|im_end|>"):
        ids = m.tokenize(text, False, True)
        if len(ids) == 1:
            special[text.strip("<|>") + "_id"] = ids[0]
    pad = m.meta("tokenizer.ggml.padding_token_id")
    if pad.isdigit():
        special["pad_token"] = m.pieces[int(pad)].decode("utf-8", "replace")
    return ModelInfo(
        model_name=name,
        model_path=str(m.path),
        architecture=m.meta("general.architecture"),
        description=m.describe(),
        fingerprint=engine.fingerprint,
        vocab_size=m.n_vocab,
        num_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.n_head_kv,
        hidden_size=m.n_embd,
        n_ctx=engine.config.n_ctx,
        n_ctx_train=m.n_ctx_train,
        n_kv_cells=engine.n_cells,
        n_slots=engine.config.n_slots,
        attention_layers=list(engine.attention_layers),
        attention_windows=[engine.layer_window(il) for il in engine.attention_layers],  # a classifier has none
        attention_sinks=m.meta("general.architecture") in SINK_ARCHITECTURES,
        memory=memory_info(engine) if isinstance(engine, Engine) else MemoryInfo(),
        rope_freq_base=float(m.meta(f"{m.meta('general.architecture')}.rope.freq_base") or 10000.0),
        rope_freq_scale=1.0,
        bos_token_id=m.bos,
        eos_token_id=m.eos,
        eot_token_id=m.boundary_eot,
        eog_token_ids=sorted(m.eog),
        special_tokens=special,
        chat_template=m.chat_template,
        n_params=int(llama.llama_model_n_params(m.ptr)),
        size_bytes=int(llama.llama_model_size(m.ptr)),
        llama_cpp_version=llama.__version__,
        runtime=runtime_info(engine),
    )
