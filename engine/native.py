"""ctypes bindings of slotserve's addition to libllama (``libllama/llama-attn.h`` in this repository).

slotserve builds its own libllama from the llama.cpp that llama-cpp-python 0.3.36 vendors, with
the small additive patch in ``libllama/`` (``scripts/setup`` builds it; docs/architecture.md,
"The patched libllama").  The patch makes the requested tokens' post-softmax attention rows graph
outputs and adds a few C functions; this module declares them on the libllama that
llama-cpp-python loaded (``llama_cpp.llama_cpp._lib``), so the engine uses one libllama and one
ggml.  :func:`require_patch` refuses a libllama without the patch (for example llama-cpp-python's
own build from PyPI) with an error that says how to fix it.
"""

from __future__ import annotations

import ctypes

import llama_cpp

ATTN_ABI = 8  # LLAMA_ATTN_ABI of libllama/llama-attn.h
PER_LAYER = 0  # enum llama_attn_format
MEAN = 1
TOP_K = 2
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1

lib = llama_cpp.llama_cpp._lib
"""libllama as llama-cpp-python loaded it; the patch's functions are declared on it by :func:`require_patch`.
ggml's symbols resolve through it too (``dlsym`` on libllama's handle searches its dependencies), so this is
the ggml llama.cpp uses (``llama_cpp._ggml`` opens ``lib/libggml.so`` by path, which a wheel may hold as a
second file: a second ggml with its own backend registry)."""


class PatchMissingError(RuntimeError):
    """The loaded libllama lacks slotserve's patch (or has another version of it)."""


class AttnRow(ctypes.Structure):
    """``struct llama_attn_row`` (libllama/llama-attn.h): one captured row in one KV cache.

    Host memory of ``type`` (``GGML_TYPE_F32``/``F16``): layer ``k``'s ``[n_head, n_kv]`` values start at
    ``layers[k]`` (heads ``nb_head`` bytes apart, a head's ``n_kv`` values contiguous); ``nb_layer`` is the
    bytes from one layer to the next when every layer is at one stride (``layers[k] == data + k * nb_layer``),
    0 when not (a decode step's rows read in place from each layer's graph output: ``in_place`` 1).  Valid
    until the next ``llama_attn_set_rows``/``llama_decode``/``llama_attn_memory_update``; ``n_kv`` counts KV
    cells of the row's stream, or is ``2 * k`` for ``TOP_K`` (per head ``k`` float32 weights in no particular
    order, then their ``k`` cells as float32 values in the same order, -1 past a row of fewer than ``k`` cells).
    """

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("n_kv", ctypes.c_int64),
        ("n_layer", ctypes.c_int32),
        ("n_head", ctypes.c_int32),
        ("nb_layer", ctypes.c_int64),
        ("nb_head", ctypes.c_int64),
        ("type", ctypes.c_int32),
        ("stream", ctypes.c_int32),
        ("layers", ctypes.POINTER(ctypes.c_void_p)),
        ("in_place", ctypes.c_int32),
    ]


class StatePiece(ctypes.Structure):
    """``struct llama_attn_state_piece`` (libllama/llama-attn.h): ``size`` bytes of a sequence state at the
    address ``data``, or, when ``data`` is NULL, of the file ``llama_attn_state_seq_read`` reads, from its
    byte ``offset``."""

    _fields_ = [("data", ctypes.c_void_p), ("offset", ctypes.c_int64), ("size", ctypes.c_uint64)]


_SIGNATURES: dict[str, tuple[list[object], object]] = {
    "llama_attn_abi": ([], ctypes.c_int32),
    "llama_attn_init": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_attn_flash_attn": ([ctypes.c_void_p], ctypes.c_bool),
    "llama_attn_memory_update": ([ctypes.c_void_p], None),
    "llama_attn_layer_cache": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    "llama_attn_set_format": (
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32],
        ctypes.c_int32,
    ),
    "llama_attn_max_top_k": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_attn_set_rows": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    "llama_attn_get_row": (
        [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(AttnRow)],
        ctypes.c_int32,
    ),
    "llama_attn_n_captured": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_attn_set_stable": ([ctypes.c_void_p, ctypes.c_bool], ctypes.c_int32),
    "llama_attn_set_in_place": ([ctypes.c_void_p, ctypes.c_bool], ctypes.c_int32),
    "llama_attn_set_cpu_ops": ([ctypes.c_void_p, ctypes.c_bool], ctypes.c_int32),
    "llama_attn_host_buffer": ([ctypes.c_void_p], ctypes.c_char_p),
    "llama_attn_cuda_graphs": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_attn_seq_cells": (
        [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p],
        ctypes.c_int32,
    ),
    "llama_attn_seq_range_get": (
        [
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ],
        ctypes.c_int64,
    ),
    "llama_attn_kv_seqs_release": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32], ctypes.c_int64),
    "llama_attn_state_seq_read": (
        [
            ctypes.c_void_p,
            ctypes.POINTER(StatePiece),
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_bool,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ],
        ctypes.c_size_t,
    ),
}


def patch_status() -> str:
    """``""`` when the loaded libllama carries this version of the patch, else why not."""
    if not hasattr(lib, "llama_attn_abi"):
        return (
            f"the libllama loaded from {lib._name} lacks slotserve's attention patch (llama-cpp-python "
            f"{llama_cpp.__version__} as built from PyPI?): run scripts/setup, which builds llama-cpp-python "
            "from the pinned llama.cpp with libllama/ applied (docs/gpu.md for CUDA)"
        )
    lib.llama_attn_abi.restype = ctypes.c_int32
    abi = lib.llama_attn_abi()
    if abi != ATTN_ABI:
        return f"libllama's attention patch has ABI {abi}, this slotserve needs {ATTN_ABI}: run scripts/setup again"
    return ""


def require_patch() -> None:
    """Declare the patch's functions; raises :class:`PatchMissingError` (saying how to fix it) without it."""
    why = patch_status()
    if why:
        raise PatchMissingError(why)
    for name, (args, res) in _SIGNATURES.items():
        func = getattr(lib, name)
        func.argtypes, func.restype = args, res
