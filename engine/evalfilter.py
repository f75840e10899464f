"""The C side of attention capture (engine/_evalfilter.c), seen from Python.

:class:`CRowCopier` builds the ``struct slotserve_filter`` that the C eval callback
reads, owns the row buffers it copies ``kq_soft_max`` rows into, and turns them into
arrays after a decode.  The C module is an optional build product (``pip install``
compiles it); :func:`available` says whether it is there, and capture falls back to
the pure Python callback without it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp as llama
import numpy as np

from engine import ggml_ffi as g

MAX_ROWS = 256  # SLOTSERVE_MAX_ROWS


class _Filter(ctypes.Structure):
    """``struct slotserve_filter`` of engine/_evalfilter.c (field for field)."""

    _fields_ = [
        ("forward", ctypes.c_void_p),
        ("forward_data", ctypes.c_void_p),
        ("tensor_get_2d", ctypes.c_void_p),
        ("off_name", ctypes.c_int64),
        ("off_op", ctypes.c_int64),
        ("off_ne", ctypes.c_int64),
        ("op_set_rows", ctypes.c_int32),
        ("forward_l0", ctypes.c_int32),
        ("n_layer", ctypes.c_int32),
        ("n_head", ctypes.c_int32),
        ("cap_kv", ctypes.c_int64),
        ("n_rows", ctypes.c_int32),
        ("error", ctypes.c_int32),
        ("n_copied", ctypes.c_int64),
        ("rows", ctypes.c_int32 * MAX_ROWS),
        ("dst", ctypes.c_void_p * MAX_ROWS),
        ("row_n_kv", ctypes.c_int32 * MAX_ROWS),
    ]


FILTER_ABI = 2  # slotserve_filter_abi() of engine/_evalfilter.c: 2 = rows read with ggml_backend_tensor_get_2d


def _library() -> ctypes.CDLL | None:
    """The built C filter, or None when it is absent or was built from another layout of its struct."""
    try:
        from engine import _evalfilter  # type: ignore[attr-defined]
    except ImportError:
        return None
    lib = ctypes.CDLL(_evalfilter.__file__)
    if not hasattr(lib, "slotserve_filter_abi") or lib.slotserve_filter_abi() != FILTER_ABI:
        return None  # a stale build: the Python callback serves until `pip install` rebuilds it
    return lib


def available() -> bool:
    """True when the C filter was built (from this source's struct layout)."""
    return _library() is not None


class CaptureOverflowError(RuntimeError):
    """The C side refused a node (row capacity exceeded, unexpected shape)."""


@dataclass
class _Row:
    buffer: int  # index into the buffer pool
    n_kv: int = 0


class CRowCopier:
    """Drives the C eval callback for one context (see module docstring).

    Per decode: :meth:`arm` with the number of output rows and the row capacity, then
    per ubatch :meth:`set_rows`, then :meth:`rows` to read ``float32[n_layer, n_head,
    n_kv]`` per output row.
    """

    def __init__(self, python_callback: object, n_layer: int, n_head: int) -> None:
        lib = _library()
        if lib is None:
            raise ImportError("engine._evalfilter is not built")
        self.n_layer = n_layer
        self.n_head = n_head
        self.f = _Filter()
        self.f.forward = ctypes.cast(python_callback, ctypes.c_void_p).value
        self.f.tensor_get_2d = ctypes.cast(g.libggml.ggml_backend_tensor_get_2d, ctypes.c_void_p).value
        self.f.off_name, self.f.off_op, self.f.off_ne = g.OFF_NAME, g.OFF_OP, g.GgmlTensor.ne.offset
        self.f.op_set_rows = g.GGML_OP_SET_ROWS
        self.f.n_layer, self.f.n_head = n_layer, n_head
        fn = ctypes.cast(lib.slotserve_eval_filter, ctypes.c_void_p).value
        self.callback = llama.ggml_backend_sched_eval_callback(fn)
        self.user_data = ctypes.addressof(self.f)
        self._pool: list[np.ndarray] = []
        self._rows: list[_Row] = []
        self._slots: list[int] = []  # filter row slot -> index in self._rows, for the current ubatch
        self._cap = 0

    def arm(self, n_out: int, cap_kv: int, forward_l0: bool) -> None:
        """Prepare ``n_out`` row buffers of ``[n_layer, n_head, cap_kv]`` for the next decode."""
        if n_out > MAX_ROWS:
            raise CaptureOverflowError(f"{n_out} attention rows in one decode (limit {MAX_ROWS})")
        self._cap = cap_kv
        size = self.n_layer * self.n_head * cap_kv
        for i in range(n_out):
            if i == len(self._pool):
                self._pool.append(np.empty(size, dtype=np.float32))
            elif self._pool[i].size < size:
                self._pool[i] = np.empty(size, dtype=np.float32)
        self._rows = [_Row(i) for i in range(n_out)]
        self._slots = []
        self.f.cap_kv = cap_kv
        self.f.n_rows = 0
        self.f.error = 0
        self.f.n_copied = 0
        self.f.forward_l0 = int(forward_l0)

    def _harvest(self) -> None:
        for slot, row in enumerate(self._slots):
            self._rows[row].n_kv = self.f.row_n_kv[slot]
        self._slots = []

    def set_rows(self, rows: list[tuple[int, int]]) -> None:
        """The current ubatch's rows: ``(row within the ubatch, output index)``."""
        self._harvest()
        for slot, (local, out) in enumerate(rows):
            self.f.rows[slot] = local
            self.f.dst[slot] = self._pool[out].ctypes.data
            self.f.row_n_kv[slot] = 0
            self._slots.append(out)
        self.f.n_rows = len(rows)

    def finish(self) -> int:
        """End of the decode: returns how many softmax nodes were copied; raises on a C error."""
        self._harvest()
        self.f.n_rows = 0
        if self.f.error:
            reason = {1: "n_kv exceeds the row capacity", 2: "unexpected kq_soft_max shape or name"}
            raise CaptureOverflowError(reason.get(self.f.error, f"error {self.f.error}"))
        return int(self.f.n_copied)

    def rows(self, out: int) -> np.ndarray:
        """``float32[n_layer, n_head, n_kv]`` view of output row ``out`` (valid until the next arm)."""
        n_kv = self._rows[out].n_kv
        buf = self._pool[out][: self.n_layer * self.n_head * self._cap]
        return buf.reshape(self.n_layer, self.n_head, self._cap)[:, :, :n_kv]
