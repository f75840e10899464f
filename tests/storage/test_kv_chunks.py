"""slotstate.kv_chunks without an engine: the chunk plan of a conversation's turns, keys, sealing, and joining
records of llama.cpp's layout (both V layouts) built here by hand."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from slotstate import kv_chunks
from slotstate.errors import BadStateError

RNG = np.random.default_rng(3)
N_LAYER, K_ROW, N_EMBD_V, EL = 2, 16, 4, 2


def record(p0: int, p1: int, v_trans: int, kv: np.ndarray) -> bytes:
    """A record of positions ``[p0, p1)`` whose K/V rows are rows ``p0..p1`` of ``kv`` ``[layer, 2, pos, 16]``."""
    n = p1 - p0
    if n == 0:
        return struct.pack("<I", 0)
    out = struct.pack("<I", n) + b"".join(struct.pack("<iIi", p, 1, 0) for p in range(p0, p1))
    out += struct.pack("<II", v_trans, N_LAYER)
    for layer in range(N_LAYER):
        out += struct.pack("<iQ", 1, K_ROW) + kv[layer, 0, p0:p1].tobytes()
    for layer in range(N_LAYER):
        v = kv[layer, 1, p0:p1, : N_EMBD_V * EL]  # [n, n_embd_v * el] bytes: n_embd_v f16 values per cell
        if v_trans:
            rows = v.reshape(n, N_EMBD_V, EL).transpose(1, 0, 2)  # per embedding row, the cells' elements
            out += struct.pack("<iII", 1, EL, N_EMBD_V) + np.ascontiguousarray(rows).tobytes()
        else:
            out += struct.pack("<iQ", 1, N_EMBD_V * EL) + v.tobytes()
    return out


@pytest.mark.parametrize("v_trans", [0, 1])
def test_joined_chunks_are_the_whole_record(v_trans: int) -> None:
    kv = RNG.integers(0, 256, (N_LAYER, 2, 700, K_ROW), dtype=np.uint8)
    whole = record(0, 700, v_trans, kv)
    ranges = kv_chunks.chunk_bounds(700, 256)
    assert ranges == [(0, 256), (256, 512), (512, 700)]
    parts = [record(p0, p1, v_trans, kv) for p0, p1 in ranges]
    assert bytes(kv_chunks.join_records(parts)) == whole
    assert bytes(kv_chunks.join_records([*parts[:1], struct.pack("<I", 0), *parts[1:]])) == whole, "empty skipped"
    assert bytes(kv_chunks.join_records([])) == struct.pack("<I", 0)
    framed = kv_chunks.join_records(parts, before=b"head", after=b"the rest")
    assert bytes(framed) == b"head" + whole + b"the rest", "one buffer: what comes before, the record, what after"
    assert bytes(kv_chunks.join_records([], before=b"h", after=b"t")) == b"h" + struct.pack("<I", 0) + b"t"
    with pytest.raises(BadStateError, match="ascend"):
        kv_chunks.join_records([parts[1], parts[0]])
    other = record(0, 10, 1 - v_trans, kv)
    with pytest.raises(BadStateError, match="different"):
        kv_chunks.join_records([other, parts[1]])
    with pytest.raises(BadStateError):
        kv_chunks.parse_record(parts[0][:-1])
    state = kv_chunks.state_of([whole])
    assert state[:12] == struct.pack("<IiI", 0xAF143CD8, 0, 1) and state[12:] == whole


def test_plan_of_a_conversation() -> None:
    """Turns of 10 tokens after a 1,000-token prompt: one range per chunk the new tokens touch, the last
    one partial until a turn completes it; a change of the tokens drops the ranges after it."""
    size = 256
    first = kv_chunks.plan_ranges(1010, [], 0, size)
    assert first == [(0, 256), (256, 512), (512, 768), (768, 1010)]
    second = kv_chunks.plan_ranges(1020, first, 1010, size)
    assert second == [*first, (1010, 1020)]
    third = kv_chunks.plan_ranges(1030, second, 1020, size)
    assert third == [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1030)], "the chunk completed"
    cut = kv_chunks.plan_ranges(600, third, 600, size)
    assert cut == [(0, 256), (256, 512), (512, 600)], "a truncation keeps the ranges before it"
    changed = kv_chunks.plan_ranges(1030, third, 300, size)
    assert changed == [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1030)]
    assert kv_chunks.plan_ranges(0, third, 0, size) == []
    with pytest.raises(ValueError):
        kv_chunks.chunk_bounds(10, 0)


def test_plan_cut_at_the_first_message_end() -> None:
    """A system prompt ending at 1,000 (no multiple of 256): the chunk holding its end is stored as
    [768, 1000) and [1000, ...), also once a turn completes the chunk, so every conversation with that
    prompt names the same [768, 1000) range; ranges stored before the cut was known merge whole."""
    size, cut = 256, 1000
    first = kv_chunks.plan_ranges(1010, [], 0, size, cut)
    assert first == [(0, 256), (256, 512), (512, 768), (768, 1000), (1000, 1010)]
    second = kv_chunks.plan_ranges(1030, first, 1010, size, cut)
    assert second == [(0, 256), (256, 512), (512, 768), (768, 1000), (1000, 1024), (1024, 1030)]
    assert kv_chunks.plan_ranges(1300, second, 1030, size, cut)[3:] == [
        (768, 1000),
        (1000, 1024),
        (1024, 1280),
        (1280, 1300),
    ]
    assert kv_chunks.plan_ranges(990, [], 0, size, cut)[-1] == (768, 990), "a cut past the tokens is none"
    assert kv_chunks.plan_ranges(1030, first, 995, size, cut)[3:] == [(768, 1000), (1000, 1024), (1024, 1030)]
    old = kv_chunks.plan_ranges(1010, [], 0, size)
    assert kv_chunks.plan_ranges(1030, old, 1010, size, cut)[3:] == [(768, 1024), (1024, 1030)]
    tokens = RNG.integers(0, 50_000, 1100).tolist()
    a = kv_chunks.plan_ranges(1010, [], 0, size, cut)
    b = kv_chunks.plan_ranges(1040, [], 0, size, cut)
    other = tokens[:cut] + [7] * 100
    ka = kv_chunks.chunk_keys(b"s", tokens, a)
    kb = kv_chunks.chunk_keys(b"s", other, b)
    assert ka[:4] == kb[:4] and ka[4] != kb[4], "the prompt's partial chunk is shared, the rest is not"


def test_keys_follow_scope_prefix_and_bounds() -> None:
    tokens = RNG.integers(0, 50_000, 600).tolist()
    ranges = [(0, 256), (256, 512), (512, 600)]
    keys = kv_chunks.chunk_keys(b"fp\0tenant\0", tokens, ranges)
    assert len(set(keys)) == 3 and all(len(k) == 32 and not k.strip("0123456789abcdef") for k in keys)
    assert kv_chunks.chunk_keys(b"fp\0tenant\0", tokens[:512] + [1] * 88, ranges)[:2] == keys[:2], "same prefix"
    assert kv_chunks.chunk_keys(b"fp\0tenant\0", [9, *tokens[1:]], ranges)[0] != keys[0], "another prefix"
    assert kv_chunks.chunk_keys(b"fp\0other\0", tokens, ranges)[0] != keys[0], "another tenant"
    assert kv_chunks.chunk_keys(b"fp\0tenant\0", tokens, [(0, 256), (256, 500)])[1] != keys[1], "other bounds"
    with pytest.raises(ValueError):
        kv_chunks.chunk_keys(b"", tokens, [(10, 20)])


def test_sealed_chunks_refuse_damage() -> None:
    body = RNG.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    key = "0123456789abcdef" * 2
    sealed = kv_chunks.seal(body, key)
    assert bytes(kv_chunks.unseal(sealed, key)) == body
    for bad in (sealed[:-1], sealed + b"\0", sealed[:40] + bytes([sealed[40] ^ 1]) + sealed[41:], b"KVC1", b""):
        with pytest.raises(BadStateError):
            kv_chunks.unseal(bad, key)
    with pytest.raises(BadStateError, match="checksum"):
        kv_chunks.unseal(sealed, "f" * 32)  # whole, but stored under another chunk's key
