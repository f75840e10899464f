"""Slot files (llama.cpp's sequence-state files, ``ggsq``) written and read by the engine itself.

llama-server's ``POST /slots/{id}?action=save|restore`` (``tools/server/README.md``) writes and
reads ``--slot-save-path/FILENAME`` with ``llama_state_seq_save_file`` /
``llama_state_seq_load_file`` (``include/llama.h``); the format is :mod:`storage.ggsq`'s.
When the worker shares the orchestrator's file system (it spawned the worker), the worker
does the same, so a slot's tens of MB never cross the worker's socket:

* :func:`write_slot_file` writes the sequence's state (the copy the engine keeps, or one read
  from the KV cache, lent by :meth:`engine.engine.Engine.lend_state`) beside the target and
  renames it over it, on a thread of its own: a file write can take far longer than a decode
  step (ext4 throttles a writer of tens of MB of dirty pages), and the decode loop must not
  wait for it.
* :func:`load_seq_file` parses the whole file before llama.cpp sees it (header, token record,
  and every header field and the length of the state, on a memory map without reading the
  K/V data: :func:`engine.seq_state.parse_file`; ``llama_state_seq_load_file`` aborts the
  process on a file cut short), lets ``llama_state_seq_load_file`` read the K/V data straight
  into the scratch sequence's cells (llama.cpp reads it in pieces through a small buffer:
  ~17 ms for 46 MB on the project's 2-core VM, where reading the file into one buffer alone
  took ~20 ms), then tests those cells' K/V values for NaN/infinity where they lie
  (:meth:`engine.kv_io.KvReader.nonfinite`) and zeroes them again when it refuses the file.
  The file is opened once: llama.cpp reads it through ``/proc/self/fd``, so a file renamed
  over it meanwhile is not mixed in.  A state of several KV streams (llama-server ``-np N``
  without ``--kv-unified``), or an engine without the cell mirror (capture off), goes the
  general way: the file read into a buffer, :func:`engine.seq_state.single_stream`,
  :meth:`engine.engine.Engine.restore_state`.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from pathlib import Path
from typing import BinaryIO

import llama_cpp as llama
import numpy as np

from engine import seq_state
from engine.engine import Engine, EngineError
from engine.errors import ErrorCode
from storage.errors import BadStateError
from storage.ggsq import read_seq_file, read_seq_head, write_seq_file


def write_slot_file(path: Path, tokens: list[int], state: bytes | bytearray | memoryview) -> int:
    """Write ``tokens`` and their llama.cpp sequence ``state`` to ``path`` as llama-server's slot
    file, beside it first and renamed over it; returns the bytes written.  Touches no llama.cpp
    object, so it may run on another thread than the engine's (the worker's writer thread).

    Raises ``EngineError(INVALID_REQUEST)`` when ``path`` names a directory and
    ``EngineError(INTERNAL)`` for any other write failure (the target is then unchanged).
    """
    try:
        return write_seq_file(path, tokens, state)
    except IsADirectoryError as exc:
        raise EngineError(ErrorCode.INVALID_REQUEST, f"invalid filename {path.name!r}: it names a directory") from exc
    except (OSError, BadStateError) as exc:
        raise EngineError(ErrorCode.INTERNAL, f"could not write the slot file {path.name!r}: {exc}") from exc


def load_seq_file(engine: Engine, seq: int, path: Path) -> tuple[int, int, float]:
    """Replace ``seq`` with the slot file ``path`` (llama-server's or ours); ``(n_tokens, file
    bytes, ms)``.  ``seq`` is untouched on failure.

    The general way (see the module docstring) reads into a buffer of the engine's
    ``state_pool``.  Raises ``EngineError(INVALID_REQUEST)`` for a missing file or a directory,
    and ``EngineError(BAD_STATE)`` for a file this engine cannot take: not ``ggsq``, another
    model's or KV type's state, cut short or padded, or holding NaN/infinite K/V values; also
    what :meth:`engine.engine.Engine.place` raises.
    """
    t0 = time.perf_counter()
    try:
        with open(path, "rb") as f:
            tokens, words, state_size = read_seq_head(f)
            size = f.tell() + state_size
            n_stream = struct.unpack("<I", f.read(4))[0] if state_size >= 4 else 0
            if engine.reader.fast is None or n_stream != engine.layout.n_stream:
                f.seek(0)
                parsed = engine.state_pool.fill(lambda take: read_seq_file(f, take))
                try:
                    state = seq_state.single_stream(parsed.state)
                    engine.restore_state(seq, parsed.tokens, memoryview(state), check_values=True)
                finally:
                    engine.state_pool.give(parsed.state)
            else:
                # every header field and the length checked before llama.cpp reads the file: its
                # loader aborts the process on a file cut short
                positions = seq_state.parse_file(f, size - state_size, engine.layout).positions

                def fill(s: int, cells: np.ndarray | None) -> None:
                    assert cells is not None  # the fast reader exists only with the mirror (capture on)
                    _fill_from_file(engine, s, f, words, cells, positions, size)

                engine.place(seq, tokens, positions, fill)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise EngineError(ErrorCode.INVALID_REQUEST, f"no saved slot file {path.name!r}") from exc
    except (BadStateError, seq_state.BadStateError) as exc:
        raise EngineError(ErrorCode.BAD_STATE, f"Unable to restore slot: {exc}") from exc
    except OSError as exc:
        raise EngineError(ErrorCode.INTERNAL, f"could not read the slot file {path.name!r}: {exc}") from exc
    return len(tokens), size, (time.perf_counter() - t0) * 1000


def _fill_from_file(
    engine: Engine, s: int, f: BinaryIO, words: list[int], cells: np.ndarray, positions: np.ndarray, size: int
) -> None:
    """``llama_state_seq_load_file`` of the open file ``f`` (``size`` bytes) into the empty scratch
    sequence ``s``, whose cells will be ``cells`` (state order); refused and zeroed again unless
    llama.cpp took all of it, read the same token words and every K/V value is finite."""
    fast = engine.reader.fast
    assert fast is not None
    proc = f"/proc/self/fd/{f.fileno()}"
    name = proc if os.path.exists(proc) else f.name
    cap = max(len(words), 1)
    out = (llama.llama_token * cap)()
    count = ctypes.c_size_t(0)
    got = llama.llama_state_seq_load_file(engine.ctx, os.fsencode(name), s, out, cap, ctypes.byref(count))
    try:
        if not got:
            raise EngineError(ErrorCode.BAD_STATE, "Unable to restore slot: llama.cpp refused the sequence state")
        if count.value != len(words) or list(out[: count.value]) != words:
            raise EngineError(ErrorCode.BAD_STATE, "Unable to restore slot: the file changed while it was read")
        if got != size:
            raise EngineError(ErrorCode.BAD_STATE, f"Unable to restore slot: {size - got} bytes after the state")
        pos2cell = np.empty(len(cells), dtype=np.int32)
        pos2cell[positions] = cells
        bad = fast.nonfinite(s, pos2cell)
        if bad is not None:
            raise EngineError(ErrorCode.BAD_STATE, f"Unable to restore slot: {bad}")
    except BaseException:
        fast.zero(cells)
        raise
