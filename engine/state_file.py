"""Slot files (llama.cpp's sequence-state files, ``ggsq``) written and read by the engine itself.

llama-server's ``POST /slots/{id}?action=save|restore`` (``tools/server/README.md``) writes and
reads ``--slot-save-path/FILENAME`` with ``llama_state_seq_save_file`` /
``llama_state_seq_load_file`` (``include/llama.h``); the format is :mod:`slotstate.ggsq`'s.
When the worker shares the orchestrator's file system (it spawned the worker), the worker
does the same, so a slot's tens of MB never cross the worker's socket:

* :func:`write_slot_file` writes the sequence's state (read from the KV cache by
  :meth:`engine.engine.Engine.save_state`, handed back once written) beside the target and
  renames it over it, on a thread of its own: a file write can take far longer than a decode
  step (ext4 throttles a writer of tens of MB of dirty pages), and the decode loop must not
  wait for it.
* :func:`load_seq_file` parses the file's header, token record and the state's structure (small reads:
  the K/V data is not read), then has libllama read the state's records straight from the file
  (a read-only mapping of it), testing each block of K/V values for NaN/infinity while it is in cache before
  it goes into the KV cache (:mod:`engine.state_read`): one pass over the file, as llama.cpp's
  ``llama_state_seq_load_file`` reads it, and one copy.  A sequence that holds cells is loaded the way the API's
  restore is (:meth:`engine.engine.Engine.restore_state`): the file read once into a page-aligned
  buffer of the engine's ``state_pool`` and its values tested before anything is written, so that a
  refusal leaves its cells as they were.  llama.cpp never reads the file itself: its
  ``llama_state_seq_load_file`` aborts the process on a file cut short, and writes what it loads into
  the cache without testing it (a NaN even in a free cell poisons every later decode: masked cells' V
  is multiplied by weight 0, and NaN * 0 is NaN).  A state of several KV streams (llama-server ``-np N``
  without ``--kv-unified``) is taken as it is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from contract.errors import ErrorCode
from engine.engine import Engine
from engine.errors import EngineError
from engine.state_read import StateSource
from slotstate import seq_state
from slotstate.ggsq import read_seq_file, read_seq_head, write_seq_file


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
    except (OSError, seq_state.BadStateError) as exc:
        raise EngineError(ErrorCode.INTERNAL, f"could not write the slot file {path.name!r}: {exc}") from exc


def load_seq_file(engine: Engine, seq: int, path: Path) -> tuple[int, int, float]:
    """Replace ``seq`` with the slot file ``path`` (llama-server's or ours); ``(n_tokens, file
    bytes, ms)``.  ``seq`` is untouched on failure (an empty one stays empty).

    See the module docstring for how the file is read.  Raises ``EngineError(INVALID_REQUEST)`` for a
    missing file or a directory, and ``EngineError(BAD_STATE)`` for a file this engine cannot take:
    not ``ggsq``, another model's or KV type's state, cut short or padded, or holding NaN/infinite
    K/V values; also what :meth:`engine.engine.Engine.restore_parsed` raises.
    """
    t0 = time.perf_counter()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if engine.tokens.get(seq):  # cells to keep on a refusal: the values are tested before the restore
                parsed = engine.state_pool.fill(lambda take: read_seq_file(f, take))
                try:
                    engine.restore_state(seq, parsed.tokens, memoryview(parsed.state), check_values=True)
                finally:
                    engine.state_pool.give(parsed.state)
                return len(parsed.tokens), size, (time.perf_counter() - t0) * 1000
            tokens, _ = read_seq_head(f)
            start = f.tell()
            state = seq_state.parse_file(f, start, engine.layout)
            engine.restore_parsed(seq, tokens, state, StateSource(fd=f.fileno(), start=start), check_values=True)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise EngineError(ErrorCode.INVALID_REQUEST, f"no saved slot file {path.name!r}") from exc
    except seq_state.BadStateError as exc:
        raise EngineError(ErrorCode.BAD_STATE, f"Unable to restore slot: {exc}") from exc
    except OSError as exc:
        raise EngineError(ErrorCode.INTERNAL, f"could not read the slot file {path.name!r}: {exc}") from exc
    return len(tokens), size, (time.perf_counter() - t0) * 1000
