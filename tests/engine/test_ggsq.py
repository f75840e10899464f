"""llama.cpp's sequence-state file (``ggsq``): packing, both token layouts, bad files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from slotstate.ggsq import GGSQ_MAGIC, IO_MAGIC, pack_seq_file, unpack_seq_file, write_seq_file
from slotstate.seq_state import BadStateError

STATE = struct.pack("<Ii", IO_MAGIC, 3) + b"\x01\x00\x00\x00kv-bytes"


def test_round_trip_packed_layout() -> None:
    data = pack_seq_file([5, 6, 7], STATE)
    magic, version, n_words = struct.unpack_from("<III", data)
    assert (magic, version) == (GGSQ_MAGIC, 3) and data[:4] == b"qsgg"
    words = np.frombuffer(data, dtype="<i4", count=n_words, offset=12)
    assert list(words) == [-1, 1, 3, 5, 6, 7, 0]  # LLAMA_TOKEN_NULL, version, n, tokens, no media
    assert data[12 + 4 * n_words :] == STATE[8:]  # the file holds the state without io magic + seq id
    back = unpack_seq_file(data)
    assert back.tokens == [5, 6, 7]
    assert back.state == struct.pack("<Ii", IO_MAGIC, 0) + STATE[8:]


def test_plain_token_list_of_older_servers() -> None:
    data = struct.pack("<III", GGSQ_MAGIC, 3, 2) + struct.pack("<ii", 9, 8) + b"kv"
    got = unpack_seq_file(data)
    assert got.tokens == [9, 8] and got.state.endswith(b"kv")


@pytest.mark.parametrize(
    ("data", "msg"),
    [
        (b"SES1" + b"\x00" * 20, "magic"),
        (struct.pack("<III", GGSQ_MAGIC, 2, 0), "version 2"),
        (struct.pack("<III", GGSQ_MAGIC, 3, 1000) + b"\x00" * 8, "exceeds"),
        (struct.pack("<III", GGSQ_MAGIC, 3, 5) + struct.pack("<iIIiI", -1, 1, 1, 4, 1), "media"),
        (struct.pack("<III", GGSQ_MAGIC, 3, 4) + struct.pack("<iIIi", -1, 7, 1, 4), "version 7"),
        (b"qs", "too short"),
    ],
)
def test_bad_files(data: bytes, msg: str) -> None:
    with pytest.raises(BadStateError, match=msg):
        unpack_seq_file(data)


def test_pack_refuses_non_state() -> None:
    with pytest.raises(BadStateError):
        pack_seq_file([1], b"SES1....")


def test_a_written_file_is_exactly_the_packed_bytes_over_a_longer_one(tmp_path: Path) -> None:
    """The file's blocks are allocated ahead of the write (``posix_fallocate``): the file must still end where
    the state ends, replacing a longer file of the same name, and leave no temporary file beside it."""
    path = tmp_path / "slot.bin"
    path.write_bytes(b"\xff" * 100_000)
    big = struct.pack("<Ii", IO_MAGIC, 3) + bytes(range(256)) * 300  # several pages
    n = write_seq_file(path, [5, 6, 7], big)
    assert n == path.stat().st_size == len(pack_seq_file([5, 6, 7], big))
    assert path.read_bytes() == pack_seq_file([5, 6, 7], big)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot.bin"]
