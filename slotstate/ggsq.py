"""llama.cpp's sequence-state file (magic ``ggsq``), as llama-server's slot ``save``/``restore`` write it.

``llama_state_seq_save_file`` (llama.cpp ``src/llama-context.cpp``, ``include/llama.h``:
``LLAMA_STATE_SEQ_MAGIC`` = ``0x67677371``, ``LLAMA_STATE_SEQ_VERSION`` = 3) writes,
little-endian::

    u32 magic | u32 version | u32 n_token_count | n_token_count x i32 "tokens" | KV state

where the KV state is what ``llama_state_seq_get_data`` returns *without* its first 8 bytes
(``u32 io_magic | i32 seq_id``).  llama-server (``tools/server/server-common.cpp``,
``server_tokens::serialize``) stores in the token words not the plain tokens but a packed
record, zero-padded to whole words::

    i32 LLAMA_TOKEN_NULL (-1) | u32 version (1) | u32 n | n x i32 tokens | u32 n_media | media...

Older servers wrote the plain token list; :func:`unpack_seq_file` reads both, like
llama-server's ``server_tokens::deserialize``.  This module converts such files to and from
``(tokens, llama_state_seq_get_data blob)``, so a file moves between llama-server and slotserve.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from slotstate.errors import BadStateError

GGSQ_MAGIC = 0x67677371
GGSQ_VERSION = 3
IO_MAGIC = 0xAF143CD8  # the first u32 of llama_state_seq_get_data's output
TOKEN_NULL = -1
SERVER_TOKENS_VERSION = 1
_HEAD = struct.Struct("<III")


@dataclass(frozen=True)
class SeqFile:
    """A parsed sequence-state file: the slot's tokens and the state as ``llama_state_seq_set_data`` takes it."""

    tokens: list[int]
    state: bytes | bytearray | memoryview


def seq_file_chunks(tokens: list[int], state: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
    """The file llama-server writes for a slot holding ``tokens`` with ``state``
    (``llama_state_seq_get_data`` output, starting with its io magic), as two chunks to write
    in order: the header with the token record, and a view of the state's KV part (not copied).
    Raises :class:`BadStateError` when ``state`` does not start with the io magic."""
    view = memoryview(state).cast("B")
    if len(view) < 8 or struct.unpack_from("<I", view)[0] != IO_MAGIC:
        raise BadStateError("not a llama.cpp sequence state")
    packed = np.empty(3 + len(tokens) + 1, dtype="<i4")
    packed[:3] = (TOKEN_NULL, SERVER_TOKENS_VERSION, len(tokens))
    packed[3 : 3 + len(tokens)] = tokens
    packed[-1] = 0  # no media chunks
    return [_HEAD.pack(GGSQ_MAGIC, GGSQ_VERSION, len(packed)) + packed.tobytes(), view[8:]]


def pack_seq_file(tokens: list[int], state: bytes | bytearray | memoryview) -> bytes:
    """:func:`seq_file_chunks` joined into one ``bytes``."""
    return b"".join(seq_file_chunks(tokens, state))


def _server_tokens(words: np.ndarray) -> list[int]:
    """``server_tokens::deserialize``: the packed record, or a plain token list."""
    if len(words) == 0 or int(words[0]) != TOKEN_NULL:
        return [int(t) for t in words]
    raw = words.tobytes()
    if len(raw) < 12:
        raise BadStateError("truncated token record in the slot file")
    version, n = struct.unpack_from("<II", raw, 4)
    if version != SERVER_TOKENS_VERSION:
        raise BadStateError(f"unsupported server tokens version {version}")
    end = 12 + 4 * n
    if end + 4 > len(raw):
        raise BadStateError("truncated token record in the slot file")
    (n_media,) = struct.unpack_from("<I", raw, end)
    if n_media:
        raise BadStateError("the slot file holds media (image/audio) chunks, which this server cannot restore")
    if len(raw) - (end + 4) >= 4:
        raise BadStateError("trailing data in the slot file's token record")
    return [int(t) for t in words[3 : 3 + n]]


def _parse_head(head: bytes | memoryview, size: int) -> int:
    """Check the 12-byte header of a file of ``size`` bytes; the number of token words."""
    if size < _HEAD.size:
        raise BadStateError("not a llama.cpp sequence-state file (too short)")
    magic, version, n_words = _HEAD.unpack_from(head)
    if magic != GGSQ_MAGIC:
        raise BadStateError(f"not a llama.cpp sequence-state file (magic {magic:#x}, expected 'ggsq')")
    if version != GGSQ_VERSION:
        raise BadStateError(f"sequence-state file version {version}; this llama.cpp reads version {GGSQ_VERSION}")
    if _HEAD.size + 4 * n_words > size:
        raise BadStateError("token count in the sequence-state file exceeds the file size")
    return n_words


def unpack_seq_file(data: bytes) -> SeqFile:
    """Parse a ``ggsq`` file's bytes; raises :class:`BadStateError` for anything else.

    The returned ``state`` carries the io magic and source sequence 0 in front, as
    ``llama_state_seq_set_data`` expects; its KV part is checked by the engine.
    """
    n_words = _parse_head(data, len(data))
    end = _HEAD.size + 4 * n_words
    tokens = _server_tokens(np.frombuffer(data, dtype="<i4", count=n_words, offset=_HEAD.size))
    return SeqFile(tokens, struct.pack("<Ii", IO_MAGIC, 0) + data[end:])


def read_seq_head(file: BinaryIO) -> tuple[list[int], int]:
    """The header and token record of the ``ggsq`` file ``file`` (left at its KV state):
    ``(tokens, state_size)``, the slot's tokens and the bytes of KV state that follow.

    Raises :class:`BadStateError` for anything but a ``ggsq`` file, ``OSError`` when reading fails.
    """
    size = os.fstat(file.fileno()).st_size
    n_words = _parse_head(file.read(_HEAD.size), size)
    words = np.frombuffer(file.read(4 * n_words), dtype="<i4")
    if len(words) != n_words:
        raise BadStateError("the sequence-state file ended inside its token record")
    return _server_tokens(words), size - _HEAD.size - 4 * n_words


def read_seq_file(file: BinaryIO, alloc: Callable[[int], bytearray | memoryview] = bytearray) -> SeqFile:
    """:func:`unpack_seq_file` of an open file, reading the KV state once, straight into the
    buffer returned (``alloc(n)``, writable, of ``n`` bytes; behind the 8 bytes of io magic and
    sequence 0 it needs in front).

    Raises :class:`BadStateError` for anything but a ``ggsq`` file, ``OSError`` when reading fails.
    """
    tokens, state_size = read_seq_head(file)
    state = alloc(8 + state_size)
    struct.pack_into("<Ii", state, 0, IO_MAGIC, 0)
    if file.readinto(memoryview(state)[8:]) != len(state) - 8:  # type: ignore[attr-defined]
        raise BadStateError("the sequence-state file ended inside its state")
    return SeqFile(tokens, state)


def write_seq_file(path: Path, tokens: list[int], state: bytes | bytearray | memoryview) -> int:
    """Write the file llama-server writes for a slot holding ``tokens`` with ``state``
    (:func:`seq_file_chunks`) to ``path``: beside it first (``.NAME.tmp``), then renamed over it,
    so a reader never sees half a file, nor the new bytes after the old header it read (llama-server
    writes in place; its format has no checksum to refuse a state mixed of two saves of the same length).
    The new file's blocks are allocated before it is written (:func:`_allocate`).  Returns the bytes
    written; raises ``OSError`` (``IsADirectoryError`` when ``path`` names a directory) and
    :class:`BadStateError`."""
    chunks = seq_file_chunks(tokens, state)
    size = sum(memoryview(c).nbytes for c in chunks)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            _allocate(f.fileno(), size)
            f.writelines(chunks)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return size


def _allocate(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of the new file ``fd`` before writing them (``posix_fallocate(3)``), where
    the platform has it.  Why: ext4 (``auto_da_alloc``, the default, ``Documentation/admin-guide/ext4.rst``
    in the Linux sources) starts writing back a file renamed over another one inside the ``rename``, for
    every block still awaiting delayed allocation; written into allocated blocks, a 46 MB slot file's
    save-and-rename took 37 ms instead of 87 ms on this project's test VM (docs/benchmarks.md).  A
    file system that cannot allocate ahead is written as before (an ``OSError`` here is not an error)."""
    if size > 0 and hasattr(os, "posix_fallocate"):
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, size)
