"""The SES1 slot-state blob format of ``save-state``/``restore-state`` (docs/api.md, "Slots").

Layout, all integers little-endian::

    offset 0      4 bytes   magic b"SES1"
    offset 4      u32       n_tokens
    offset 8      n_tokens x i32   token ids (llama_token)
    offset 8+4n   rest      opaque llama.cpp sequence state (``llama_state_seq_get_data`` bytes)

The state part is not interpreted here. :func:`unpack_ses1` returns it as a zero-copy
``memoryview`` into the input blob.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slotstate.errors import BadStateError

__all__ = ["HEADER_SIZE", "MAGIC", "MAX_TOKENS", "Ses1", "pack_ses1", "ses1_header", "ses1_tokens", "unpack_ses1"]

MAGIC = b"SES1"
_HEADER = struct.Struct("<4sI")
HEADER_SIZE = _HEADER.size  # 8 bytes: magic + u32 n_tokens
MAX_TOKENS = 1 << 24
"""Largest n_tokens accepted (16,777,216): far above any context length; larger counts mean garbage."""

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True, slots=True)
class Ses1:
    """A decoded SES1 blob.

    Attributes:
        tokens: the token ids (int32 values) of the sequence, in position order.
        state: the llama.cpp sequence state bytes, a view into the original blob (keep the blob alive).
    """

    tokens: list[int]
    state: memoryview


def ses1_header(tokens: Sequence[int]) -> bytes:
    """The SES1 blob of ``tokens`` up to its state: ``b"SES1" + u32 len(tokens) + int32 LE tokens``
    (send the state after it to make the blob without copying the state).

    Raises:
        ValueError: more than :data:`MAX_TOKENS` tokens, or a token id outside int32.
    """
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{len(tokens)} tokens exceed the SES1 limit of {MAX_TOKENS}")
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if arr.size and (int(arr.min()) < _I32_MIN or int(arr.max()) > _I32_MAX):
        raise ValueError("token ids must fit in int32")
    return _HEADER.pack(MAGIC, arr.size) + arr.astype("<i4").tobytes()


def pack_ses1(tokens: Sequence[int], state: bytes | bytearray | memoryview) -> bytes:
    """Build a SES1 blob from token ids and llama.cpp sequence state bytes.

    Args:
        tokens: token ids; each must fit in int32.
        state: the opaque state bytes (copied once into the result).

    Returns:
        ``b"SES1" + u32 len(tokens) + int32 LE tokens + state``.

    Raises:
        ValueError: more than :data:`MAX_TOKENS` tokens, or a token id outside int32.
    """
    return b"".join((ses1_header(tokens), memoryview(state)))


def _parse_header(blob: bytes | bytearray | memoryview) -> tuple[memoryview, int]:
    view = memoryview(blob).cast("B")
    if len(view) < HEADER_SIZE:
        raise BadStateError(f"SES1 blob truncated: {len(view)} bytes, header needs {HEADER_SIZE}")
    magic, n_tokens = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BadStateError(f"not a SES1 blob: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if n_tokens > MAX_TOKENS:
        raise BadStateError(f"SES1 n_tokens {n_tokens} is absurd (limit {MAX_TOKENS})")
    end = HEADER_SIZE + 4 * n_tokens
    if len(view) < end:
        raise BadStateError(f"SES1 blob truncated: header says {n_tokens} tokens ({end} bytes), got {len(view)}")
    return view, n_tokens


def ses1_tokens(blob: bytes | bytearray | memoryview) -> list[int]:
    """Return only the token ids of a SES1 blob (validates the header like :func:`unpack_ses1`)."""
    view, n_tokens = _parse_header(blob)
    return np.frombuffer(view, dtype="<i4", count=n_tokens, offset=HEADER_SIZE).tolist()


def unpack_ses1(blob: bytes | bytearray | memoryview) -> Ses1:
    """Split a SES1 blob into its token ids and its state bytes.

    Raises:
        BadStateError: wrong magic, blob shorter than the 8-byte header or than the token array the
            header announces, or n_tokens above :data:`MAX_TOKENS`.
    """
    view, n_tokens = _parse_header(blob)
    end = HEADER_SIZE + 4 * n_tokens
    tokens = np.frombuffer(view, dtype="<i4", count=n_tokens, offset=HEADER_SIZE).tolist()
    return Ses1(tokens=tokens, state=view[end:])
