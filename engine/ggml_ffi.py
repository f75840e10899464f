"""ctypes mirror of ``struct ggml_tensor`` for the pinned llama.cpp, and tensor reads.

The attention capture callback receives raw ``ggml_tensor *`` pointers.  This module
mirrors the struct layout of ``ggml/include/ggml.h`` as vendored by
llama-cpp-python 0.3.36 (``GGML_MAX_DIMS`` 4, ``GGML_MAX_SRC`` 10,
``GGML_MAX_OP_PARAMS`` 64, ``GGML_MAX_NAME`` 64) and exposes fast field readers.
The layout is checked at start-up by :func:`check_layout` against nodes of a real
graph (names, ops and shapes we expect); a mismatch raises
:class:`GgmlLayoutError` and the worker refuses to run.
"""

from __future__ import annotations

import ctypes

import llama_cpp  # before numpy: see docs/hardware.md (load order of native libraries)
import numpy as np

# ggml's symbols as llama.cpp itself resolves them: dlsym through libllama's handle searches its
# dependencies, so this is the libggml copy llama.cpp uses.  (llama_cpp._ggml opens lib/libggml.so
# by path, which a wheel may hold as a second file beside libggml.so.0: a second ggml with its own
# backend registry.)
libggml = llama_cpp.llama_cpp._lib

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64

# enum ggml_type (ggml.h)
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
GGML_TYPE_I64 = 27

# enum ggml_op (ggml.h, 0.3.36): verified at start-up on real nodes.
GGML_OP_SET_ROWS = 42
GGML_OP_SOFT_MAX = 46


class GgmlTensor(ctypes.Structure):
    """Mirror of ``struct ggml_tensor`` (ggml.h of the pinned llama.cpp)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


OFF_OP = GgmlTensor.op.offset
OFF_NAME = GgmlTensor.name.offset
OFF_SRC = GgmlTensor.src.offset

libggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
libggml.ggml_backend_tensor_get.restype = None
libggml.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
libggml.ggml_backend_buffer_is_host.restype = ctypes.c_bool

_string_at = ctypes.string_at
_c_int_at = ctypes.c_int.from_address
_c_void_p_at = ctypes.c_void_p.from_address


class GgmlLayoutError(RuntimeError):
    """The ggml_tensor mirror does not match the loaded libggml (wrong llama-cpp-python build)."""


def node_name_prefix(t: int, n: int) -> bytes:
    """First ``n`` bytes of the tensor's name (NUL padded), read without building a struct."""
    return _string_at(t + OFF_NAME, n)


def node_op(t: int) -> int:
    """The tensor's ``enum ggml_op`` value."""
    return _c_int_at(t + OFF_OP).value


def node_src(t: int, i: int) -> int:
    """Pointer to ``src[i]`` of the tensor (0 when absent)."""
    return _c_void_p_at(t + OFF_SRC + i * ctypes.sizeof(ctypes.c_void_p)).value or 0


def tensor(t: int) -> GgmlTensor:
    """A ctypes view of the tensor struct at address ``t`` (no copy)."""
    return GgmlTensor.from_address(t)


def read_array(t: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The whole (contiguous) tensor as a numpy array of ``shape`` (row-major, ggml ``ne`` reversed).

    Host buffers are viewed in place (the view is only valid inside the eval callback);
    device buffers are copied with ``ggml_backend_tensor_get``.
    """
    st = tensor(t)
    count = int(np.prod(shape))
    nbytes = count * np.dtype(dtype).itemsize
    if st.buffer and libggml.ggml_backend_buffer_is_host(st.buffer) and st.data:
        buf = (ctypes.c_char * nbytes).from_address(st.data)
        return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)
    out = np.empty(shape, dtype=dtype)
    libggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, nbytes)
    return out


def read_rows(t: int, rows: list[int], n_planes: int, n_rows: int, row_len: int) -> np.ndarray:
    """``float32[n_planes, len(rows), row_len]``: rows ``rows`` of every plane of a contiguous F32 tensor.

    The tensor is ``[n_planes, n_rows, row_len]`` (ggml ``ne = [row_len, n_rows, n_planes]``).  Host
    buffers are read in place; from device memory only the requested rows are copied
    (``ggml_backend_tensor_get`` per row and plane), never the whole tensor.
    """
    st = tensor(t)
    if st.buffer and libggml.ggml_backend_buffer_is_host(st.buffer) and st.data:
        return read_array(t, np.float32, (n_planes, n_rows, row_len))[:, rows, :]
    out = np.empty((n_planes, len(rows), row_len), dtype=np.float32)
    row_bytes = 4 * row_len
    for p in range(n_planes):
        for i, r in enumerate(rows):
            libggml.ggml_backend_tensor_get(t, out[p, i].ctypes.data, (p * n_rows + r) * row_bytes, row_bytes)
    return out


def check_contiguous_f32(t: int) -> tuple[int, int, int, int]:
    """Return ``ne`` of an F32 tensor, raising :class:`GgmlLayoutError` unless it is contiguous."""
    st = tensor(t)
    ne = tuple(int(x) for x in st.ne)
    nb = tuple(int(x) for x in st.nb)
    if st.type != GGML_TYPE_F32 or nb[0] != 4 or nb[1] != 4 * ne[0] or nb[2] != nb[1] * ne[1]:
        raise GgmlLayoutError(f"unexpected tensor layout type={st.type} ne={ne} nb={nb}")
    return ne  # type: ignore[return-value]
