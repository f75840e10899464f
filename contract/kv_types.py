"""KV cache element types: llama-server's ``--cache-type-k`` / ``--cache-type-v`` names and their ``ggml_type``.

The names and the list are llama.cpp's own (``common/arg.cpp``, ``kv_cache_types``; the
numbers are ``enum ggml_type`` in ``ggml/include/ggml.h``).  This module imports nothing
native, so the orchestrator can validate its command line without loading llama.cpp.
"""

from __future__ import annotations

from typing import Literal

KvCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]

# name -> ggml_type id, in llama-server's order
KV_CACHE_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "iq4_nl": 20,
    "q5_0": 6,
    "q5_1": 7,
}

# The types that are not quantized: a V cache of any other type needs flash attention (llama.cpp refuses
# it without, src/llama-context.cpp)
FLOAT_KV_TYPES = frozenset({"f32", "f16", "bf16"})
