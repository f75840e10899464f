"""A parsed sequence state handed to llama.cpp in one pass: ``llama_attn_state_seq_read`` (``libllama/llama-attn.h``).

slotserve keeps a sequence's state in the one-stream form (:mod:`slotstate.seq_state`); a context with one
KV stream per sequence reads one record per stream.  The state is therefore given to libllama as pieces, in
order: the 8 bytes of io header, then per KV cache part this context's stream count, the part's record (the
cells: in place, never copied) and the empty records of the other streams, then the recurrent part as it is.
The record and the recurrent part are memory (a received state) or byte ranges of a slot file, which libllama
reads through a read-only mapping of the file, straight into the KV cache (``pread`` through a 256 KiB buffer where
the file cannot be mapped), instead of the whole file being read into memory first; a file cut while it is read
is refused (its pages past the end raise SIGBUS, which libllama catches while it reads).  With ``check_values``
libllama tests every block of F32/F16/BF16 K/V values for NaN/infinity (the rule of
:func:`slotstate.seq_state.has_nonfinite`) while the block is in cache, before it writes it into the KV cache, so a
restore makes one pass over the state.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import numpy as np

from engine import native
from slotstate import seq_state

__all__ = ["StateSource", "read_into"]

MAX_STREAMS = 256  # LLAMA_MAX_SEQ (src/llama-cparams.h)
_COUNT = [ctypes.c_uint32(n) for n in range(MAX_STREAMS + 1)]
_ZEROS = (ctypes.c_char * (4 * MAX_STREAMS))()
_IO_HEAD = ctypes.create_string_buffer(struct.pack("<Ii", seq_state.IO_MAGIC, 0), 8)


@dataclass(frozen=True)
class StateSource:
    """Where the bytes of a parsed state are.

    In memory: ``blob`` (``uint8[n]`` bytes), the state as :func:`slotstate.seq_state.parse` parsed it (io header
    included, the offsets of :class:`slotstate.seq_state.ParsedState` from its first byte).  In a file: the
    open file descriptor ``fd``, the state (without io header, as a ``ggsq`` file holds it:
    :func:`slotstate.seq_state.parse_file`) starting at byte ``start``.
    """

    blob: memoryview | None = None
    fd: int = -1
    start: int = 0

    @classmethod
    def memory(cls, blob: bytes | bytearray | memoryview) -> StateSource:
        """A state held in ``blob`` (read in place)."""
        return cls(blob=memoryview(blob).cast("B"))


def _pieces(parsed: seq_state.ParsedState, src: StateSource, n_stream: int) -> list[tuple[int | None, int, int]]:
    """``(address or None, file offset, bytes)`` of each piece (see the module docstring)."""
    if src.blob is not None:
        base = np.frombuffer(src.blob, dtype=np.uint8).ctypes.data  # the address of the blob's memory

        def at(start: int, end: int) -> tuple[int | None, int, int]:
            return base + start, 0, end - start

        head = at(0, 8)
    else:

        def at(start: int, end: int) -> tuple[int | None, int, int]:
            return None, src.start + start, end - start

        head = (ctypes.addressof(_IO_HEAD), 0, 8)
    pieces = [head]
    for start, end in parsed.records:  # each KV cache: this context's stream count, the record, empty streams
        pieces += [(ctypes.addressof(_COUNT[n_stream]), 0, 4), at(start, end)]
        pieces.append((ctypes.addressof(_ZEROS), 0, 4 * (n_stream - 1)))
    pieces.append(at(*parsed.tail))  # the recurrent part as it is
    return pieces


def read_into(
    ctx: object, seq: int, parsed: seq_state.ParsedState, src: StateSource, n_stream: int, check_values: bool
) -> str:
    """Restore ``parsed`` (read from ``src``) into sequence ``seq`` of the context ``ctx`` of ``n_stream`` KV
    streams (at most :data:`MAX_STREAMS`), testing its K/V values when ``check_values``; ``""`` when done,
    else why libllama refused it (e.g. ``"the state's V cache of layer 3 holds NaN or infinite values"``).
    After a refusal the sequence holds at most cells whose values were tested (libllama's
    ``llama_attn_state_seq_read``): remove it.  Raises ``ValueError`` for a stream count llama.cpp does
    not allow."""
    if not 1 <= n_stream <= MAX_STREAMS:
        raise ValueError(f"{n_stream} KV streams is more than llama.cpp allows")
    pieces = _pieces(parsed, src, n_stream)
    arr = (native.StatePiece * len(pieces))(*(native.StatePiece(p, off, size) for p, off, size in pieces))
    err = ctypes.create_string_buffer(256)
    want = sum(size for _, _, size in pieces)
    got = native.lib.llama_attn_state_seq_read(ctx, arr, len(pieces), src.fd, seq, check_values, err, len(err))
    if got == want:
        return ""
    return err.value.decode("utf-8", "replace") or f"llama.cpp read {got} of the state's {want} bytes"
