"""The store contract's states, run against every implementation (directory, Redis, Redis Cluster, Redis behind
Sentinel): a SES1 state saved and loaded through :mod:`storage.slot_codec` with every codec, and every damage or
mismatch refused as :class:`storage.errors.BadStateError` without changing what is stored: another model's
fingerprint, flipped or cut bytes, missing chunks, tokens that differ from the metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest

from slotstate.ses1 import pack_ses1
from storage.errors import BadStateError, FingerprintMismatchError
from storage.slot_codec import load_slot, save_slot
from tests.storage.store_records import meta_for

if TYPE_CHECKING:
    from conftest import StoreHarness

pytestmark = pytest.mark.asyncio

RNG = np.random.default_rng(7)


def ses1_state(n_tokens: int = 40, kv_values: int = 20_000) -> tuple[list[int], bytes]:
    tokens = RNG.integers(0, 50_000, n_tokens).tolist()
    state = RNG.normal(0, 1, kv_values).astype(np.float16).tobytes()
    return tokens, pack_ses1(tokens, state)


async def test_save_and_load_slot(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=4096)
    tokens, ses1 = ses1_state()
    for codec_name in ("auto", "best", "none", "zstd", "zstd-planes"):
        meta = await save_slot(store, "s", "fp-A", tokens, ses1, codec=codec_name, level=1)
        assert meta.codec in ("none", "zstd", "zstd-planes")
        assert meta.raw_size == len(ses1) and meta.tokens == tokens and meta.n_tokens == len(tokens)
        loaded = await load_slot(store, "s", "fp-A")
        assert loaded is not None
        assert loaded[1] == ses1
        assert loaded[0] == meta
    with pytest.raises(BadStateError, match="tokens differ"):
        await save_slot(store, "s", "fp-A", tokens[:-1], ses1)


async def test_load_slot_refuses_other_fingerprint(harness: StoreHarness) -> None:
    store = harness.make()
    tokens, ses1 = ses1_state()
    await save_slot(store, "s", "fp-A", tokens, ses1)
    with pytest.raises(FingerprintMismatchError) as info:
        await load_slot(store, "s", "fp-B")
    assert isinstance(info.value, BadStateError)
    assert (info.value.expected, info.value.found) == ("fp-B", "fp-A")
    loaded = await load_slot(store, "s", "fp-A")  # the refusal changed nothing
    assert loaded is not None and loaded[1] == ses1


async def test_flipped_bytes_in_stored_blob(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=2000)
    tokens, ses1 = ses1_state()
    meta = await save_slot(store, "s", "fp-A", tokens, ses1, codec="zstd-planes")
    assert meta.stored_size > 4000

    def flip(blob: bytes) -> bytes:
        damaged = bytearray(blob)
        for pos in (len(blob) // 2, len(blob) // 2 + 1, len(blob) - 5):
            damaged[pos] ^= 0x5A
        return bytes(damaged)

    await harness.mutate_blob(store, "s", flip)
    got = await store.get("s")  # the store itself cannot tell: same length
    assert got is not None and got[1] != b""
    with pytest.raises(BadStateError):
        await load_slot(store, "s", "fp-A")


async def test_truncated_stored_blob(harness: StoreHarness) -> None:
    store = harness.make(chunk_size=2000)
    tokens, ses1 = ses1_state()
    await save_slot(store, "s", "fp-A", tokens, ses1, codec="zstd")
    await harness.mutate_blob(store, "s", lambda blob: blob[:-7])
    with pytest.raises(BadStateError):
        await store.get("s")
    with pytest.raises(BadStateError):
        await load_slot(store, "s", "fp-A")


async def test_tokens_in_state_must_match_meta(harness: StoreHarness) -> None:
    store = harness.make()
    tokens, ses1 = ses1_state()
    meta = meta_for("s", ses1)
    meta.tokens, meta.n_tokens = [*tokens[:-1], tokens[-1] + 1], len(tokens)
    await store.put(meta, ses1)
    with pytest.raises(BadStateError, match="tokens differ"):
        await load_slot(store, "s", "fp-A")


async def test_missing_chunk_is_bad_state(harness: StoreHarness) -> None:
    if not harness.is_redis:
        pytest.skip("only Redis splits blobs into chunk keys")
    store = harness.make(chunk_size=1000)
    stored = await store.put(meta_for("s", b"q" * 3500), b"q" * 3500)
    await harness.raw().delete(store.chunk_key("s", stored.generation, 2))  # type: ignore[attr-defined]
    with pytest.raises(BadStateError, match=r"chunks \[2\] missing"):
        await store.get("s")


@pytest.mark.parametrize("codec_name", ["none", "zstd", "zstd-planes"])
@pytest.mark.parametrize("n_flips", [1, 100])
async def test_bit_flips_in_the_stored_state_are_bad_state(
    harness: StoreHarness, codec_name: str, n_flips: int
) -> None:
    """Flipped bits anywhere in the stored blob are refused, for every codec ("none" has no checksum of its
    own: the metadata's digest catches it); the refusal changes nothing stored."""
    store = harness.make(chunk_size=2000)
    tokens, ses1 = ses1_state()
    meta = await save_slot(store, "s", "fp-A", tokens, ses1, codec=codec_name)
    assert meta.digest.startswith("xxh3-128:") and len(meta.digest) == len("xxh3-128:") + 32
    rng = np.random.default_rng(n_flips)
    # "none": only the KV part (after the SES1 header and the tokens), where nothing else checks.
    first = 8 + 4 * len(tokens) if codec_name == "none" else 0
    positions = rng.choice(np.arange(first, meta.stored_size), size=n_flips, replace=False)
    bits = rng.integers(0, 8, n_flips)

    def flip(blob: bytes) -> bytes:
        damaged = bytearray(blob)
        for pos, bit in zip(positions, bits, strict=True):
            damaged[int(pos)] ^= 1 << int(bit)
        return bytes(damaged)

    before = await store.get("s")
    await harness.mutate_blob(store, "s", flip)
    with pytest.raises(BadStateError):
        await load_slot(store, "s", "fp-A")
    after = await store.get("s")
    assert before is not None and after is not None and after[0] == before[0]  # meta untouched


async def test_meta_without_digest_still_loads(harness: StoreHarness) -> None:
    """States stored before the digest existed (``digest`` empty) load unchecked."""
    store = harness.make()
    tokens, ses1 = ses1_state()
    meta = meta_for("s", ses1)
    meta.tokens, meta.n_tokens = tokens, len(tokens)
    assert meta.digest == ""
    await store.put(meta, ses1)
    loaded = await load_slot(store, "s", "fp-A")
    assert loaded is not None and loaded[1] == ses1
