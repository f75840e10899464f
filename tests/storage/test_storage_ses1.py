"""SES1 blob format: pack/unpack round trip and rejection of malformed blobs."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from slotstate.ses1 import HEADER_SIZE, MAX_TOKENS, pack_ses1, ses1_tokens, unpack_ses1
from storage.errors import BadStateError


def test_round_trip_layout() -> None:
    tokens = [1, 9707, 374, 264, 0, 2**31 - 1, -1]
    state = bytes(range(256)) * 3
    blob = pack_ses1(tokens, state)
    assert blob[:4] == b"SES1"
    assert struct.unpack_from("<I", blob, 4)[0] == len(tokens)
    assert np.frombuffer(blob, "<i4", len(tokens), HEADER_SIZE).tolist() == tokens
    assert blob[HEADER_SIZE + 4 * len(tokens) :] == state
    ses = unpack_ses1(blob)
    assert ses.tokens == tokens
    assert bytes(ses.state) == state
    assert ses1_tokens(blob) == tokens


def test_empty_tokens_and_state_and_memoryview_input() -> None:
    blob = pack_ses1([], memoryview(b""))
    assert blob == b"SES1\x00\x00\x00\x00"
    ses = unpack_ses1(memoryview(blob))
    assert ses.tokens == [] and bytes(ses.state) == b""


def test_state_is_a_view_not_a_copy() -> None:
    blob = bytearray(pack_ses1([5], b"abcdef"))
    ses = unpack_ses1(blob)
    blob[-1] = ord("Z")
    assert bytes(ses.state) == b"abcdeZ"


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "truncated"),
        (b"SES", "truncated"),
        (b"SES2" + struct.pack("<I", 0), "magic"),
        (b"\x00" * 64, "magic"),
        (b"SES1" + struct.pack("<I", 3) + struct.pack("<2i", 1, 2), "truncated"),
        (b"SES1" + struct.pack("<I", MAX_TOKENS + 1) + b"\x00" * 16, "absurd"),
        (b"SES1" + struct.pack("<I", 0xFFFFFFFF), "absurd"),
    ],
    ids=["empty", "short-header", "bad-magic", "zeros", "short-tokens", "too-many", "u32-max"],
)
def test_malformed_blobs_raise_bad_state(blob: bytes, message: str) -> None:
    with pytest.raises(BadStateError, match=message):
        unpack_ses1(blob)
    with pytest.raises(BadStateError):
        ses1_tokens(blob)


def test_bad_state_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        unpack_ses1(b"nope")


def test_pack_rejects_tokens_outside_int32() -> None:
    with pytest.raises(ValueError, match="int32"):
        pack_ses1([2**31], b"")
    with pytest.raises(ValueError, match="int32"):
        pack_ses1([-(2**31) - 1], b"")
