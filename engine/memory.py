"""What a model's memory is made of, from llama.cpp's own answers (decided once, at start-up).

llama.cpp picks the memory of a context from the model's architecture (``llama_model::create_memory``
in ``src/llama-model.cpp``): a KV cache (``llama_kv_cache``), a KV cache for the global layers and
one for the sliding-window layers (``llama_kv_cache_iswa``), a recurrent state
(``llama_memory_recurrent``: Mamba, RWKV), or both (``llama_memory_hybrid``, ``_hybrid_iswa``: LFM2,
Jamba, Granite 4).  :func:`memory_of` reads which from ``llama_attn_init`` (the KV caches attention
rows index: ``libllama/llama-attn.h``) and ``llama_model_is_recurrent`` / ``llama_model_is_hybrid``
(``include/llama.h``), and from that follow the parts of a sequence's state
(:class:`slotstate.seq_state.StateShape`) and what the engine can do with a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp as llama

from engine import native
from engine.model import Model
from slotstate.seq_state import StateShape


@dataclass(frozen=True)
class Memory:
    """The memory of a context: ``kind`` is ``kv``, ``iswa`` (a second KV cache for the sliding-window
    layers), ``recurrent`` or ``hybrid`` (KV cache(s) and a recurrent state); ``shape`` the parts of
    its sequence states; ``can_shift`` whether positions can be shifted (``llama_memory_can_shift``)."""

    kind: str
    shape: StateShape
    can_shift: bool

    @property
    def no_partial_reason(self) -> str:
        """Why a sequence of this memory cannot be cut at an arbitrary position (the 4xx message)."""
        if self.shape.recurrent:
            return (
                f"this model's memory ({self.kind}) keeps a recurrent state, which holds the whole sequence "
                "at its last position: it cannot be cut at an earlier one"
            )
        return (
            "this model's sliding-window KV cache no longer holds the positions before that point "
            "(its cells are reused as the sequence moves on)"
        )


class UnsupportedMemoryError(RuntimeError):
    """The model's memory is of a type slotserve does not read."""


def memory_of(ctx: llama.llama_context_p, model: Model) -> Memory:
    """The memory of ``ctx`` (see the module docstring).  Arms the patch's capture bookkeeping
    (``llama_attn_init``, which only reads the memory until rows are asked for).  Raises
    :class:`UnsupportedMemoryError` for a memory type slotserve does not read (llama.cpp's
    DeepSeek sparse-attention caches, ``src/llama-kv-cache-dsa.h`` and others)."""
    n_caches = int(native.lib.llama_attn_init(ctx))
    recurrent = bool(llama.llama_model_is_recurrent(model.ptr))
    hybrid = bool(llama.llama_model_is_hybrid(model.ptr))
    can_shift = bool(llama.llama_memory_can_shift(llama.llama_get_memory(ctx)))
    if recurrent:
        return Memory("recurrent", StateShape(0, True), can_shift)
    if n_caches < 1:
        raise UnsupportedMemoryError(
            "this model's memory is neither a KV cache, a sliding-window pair of KV caches nor a recurrent "
            "state (llama.cpp's sparse-attention caches): slotserve cannot read its sequence states",
        )
    if hybrid:
        return Memory("hybrid", StateShape(n_caches, True), can_shift)
    return Memory("iswa" if n_caches > 1 else "kv", StateShape(n_caches, False), can_shift)
