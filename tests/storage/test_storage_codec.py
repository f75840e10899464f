"""Compression codecs: round trips, the byte-plane gain on fp16 data, and corrupt-input handling."""

from __future__ import annotations

import numpy as np
import pytest

from slotstate import codec
from storage.errors import BadStateError

RNG = np.random.default_rng(1234)


def fp16_bytes(n: int) -> bytes:
    """fp16 values from a smooth distribution, like KV cache contents."""
    return RNG.normal(0.0, 1.0, n).astype(np.float16).tobytes()


SAMPLES = {
    "empty": b"",
    "one-byte": b"\x7f",
    "odd-random": RNG.integers(0, 256, 10_001, dtype=np.uint8).tobytes(),
    "random": RNG.integers(0, 256, 65_536, dtype=np.uint8).tobytes(),
    "fp16": fp16_bytes(50_000),
    "fp16-odd-tail": fp16_bytes(50_000) + b"\x01",
    "zeros": bytes(100_000),
}


@pytest.mark.parametrize("name", list(codec.CODECS))
@pytest.mark.parametrize("sample", list(SAMPLES))
def test_every_codec_round_trips(name: str, sample: str) -> None:
    data = SAMPLES[sample]
    encoded = codec.encode(data, name, level=3)
    assert codec.decode(encoded, name) == data
    assert codec.decode(memoryview(encoded), name) == data


def test_split_planes_layout() -> None:
    data = bytes([1, 2, 3, 4, 5, 6, 7])
    assert codec.split_planes(data) == bytes([1, 3, 5, 2, 4, 6, 7])
    assert codec.join_planes(codec.split_planes(data)) == data


def test_planes_beat_plain_on_fp16() -> None:
    data = fp16_bytes(1 << 20)  # 2 MiB
    plain = codec.encode(data, "zstd", 3)
    planes = codec.encode(data, "zstd-planes", 3)
    assert len(planes) < len(plain) < len(data)
    assert codec.planes_if_helps(data) == "zstd-planes"


def test_encode_best_keeps_the_smaller() -> None:
    for data in (fp16_bytes(100_000), SAMPLES["random"], b"abc" * 10_000):
        name, encoded = codec.encode_best(data, 3)
        sizes = {n: len(codec.encode(data, n, 3)) for n in ("zstd", "zstd-planes")}
        assert len(encoded) == min(sizes.values())
        assert name in sizes and sizes[name] == len(encoded)
        assert codec.decode(encoded, name) == data


def test_encode_auto_samples_large_inputs() -> None:
    data = fp16_bytes(3 << 20)  # 6 MiB > 2 x 1 MiB sample: the sampled path
    name, encoded = codec.encode_auto(data, level=1)
    assert name == "zstd-planes"
    assert codec.decode(encoded, name) == data
    small_name, small = codec.encode_auto(SAMPLES["fp16"], level=1)
    assert codec.decode(small, small_name) == SAMPLES["fp16"]


def test_unknown_codec() -> None:
    with pytest.raises(BadStateError, match="unknown codec"):
        codec.decode(b"whatever", "lz4")
    with pytest.raises(ValueError, match="unknown codec"):
        codec.encode(b"whatever", "lz4")


@pytest.mark.parametrize("name", ["zstd", "zstd-planes"])
def test_corrupt_input_raises_bad_state(name: str) -> None:
    data = fp16_bytes(100_000)
    encoded = bytearray(codec.encode(data, name, 3))
    with pytest.raises(BadStateError):
        codec.decode(b"not zstd at all", name)
    with pytest.raises(BadStateError):
        codec.decode(bytes(encoded[: len(encoded) // 2]), name)  # truncated frame
    for pos in (len(encoded) // 3, len(encoded) // 2, len(encoded) - 2):  # flipped payload/checksum bytes
        damaged = bytearray(encoded)
        damaged[pos] ^= 0xFF
        with pytest.raises(BadStateError):
            codec.decode(bytes(damaged), name)
