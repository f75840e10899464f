"""The KV of a position range (``llama_attn_seq_range_get``) against llama.cpp's own whole-sequence state.

Real engine, real models: the default model with flash attention off (V transposed) and on (the ``engine``
fixture), and a tiny sliding-window model (gpt-oss: two KV caches, the sliding one holding only the window).
A range's record must be byte for byte the slice of ``llama_state_seq_get_data``'s record for its positions,
and the records of consecutive chunks, joined, the whole record (:func:`slotstate.kv_chunks.join_records`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from contract.errors import ErrorCode
from contract.settings import EngineSettings
from engine.engine import Engine, read_state
from engine.errors import EngineError
from engine.kv_range import read_range, read_ranges
from engine.model import Model
from slotstate import kv_chunks, seq_state
from tests.engine.enginekit import Runner, llama_state
from tests.tiny_models import build_tiny_gguf

WHOLE = 2**31 - 1
TEXT = "the quick brown fox pays attention to the lazy dog, a model pays attention to the words"


def prompt(model: Model, n: int) -> list[int]:
    ids = model.tokenize(" ".join([TEXT] * (n // 8 + 1)), True, False)[:n]
    assert len(ids) == n
    return ids


def record_of(state: bytes, layout: seq_state.StateLayout, part: int = 0) -> bytes:
    """The stream record of KV cache part ``part`` in a one-stream state."""
    start, end = seq_state.parse(state, layout).records[part]
    return state[start:end]


def sliced(record: bytes, p0: int, p1: int) -> bytes:
    """The record of rows ``[p0, p1)`` of a record whose cells are positions 0..n-1 in order, cut out of it
    by hand (the reference the range read is compared with)."""
    whole = kv_chunks.parse_record(record)
    assert np.array_equal(whole.positions, np.arange(whole.n_cells)), "cells in position order"
    layout = whole.layout
    assert layout is not None
    n, m = whole.n_cells, p1 - p0
    view = memoryview(record)
    out = bytearray(struct.pack("<I", m)) + view[4 + 12 * p0 : 4 + 12 * p1]
    out += struct.pack("<II", layout.v_trans, len(layout.layers))
    n_layer = len(layout.layers)
    for i, (_, off, size) in enumerate(whole.data):
        out += view[off - 12 : off]
        if i >= n_layer and layout.v_trans:
            el, rows = layout.layers[i - n_layer].v_elem_or_row_bytes, layout.layers[i - n_layer].n_embd_v_gqa
            table = np.frombuffer(view, np.uint8, size, off).reshape(rows, n * el)
            out += table[:, p0 * el : p1 * el].tobytes()
        else:
            row = size // n
            out += view[off + p0 * row : off + p1 * row]
    return bytes(out)


def kv_by_position(record: bytes) -> tuple[np.ndarray, list[bytes]]:
    """Positions and K/V bytes of a position-ordered record, sequence ids aside."""
    r = kv_chunks.parse_record(record)
    return r.positions, [bytes(r.view[o : o + n]) for _, o, n in r.data]


def test_range_reads_are_slices_of_the_state(engine: Engine, model: Model) -> None:
    """A prompt longer than a batch beside another sequence: the whole range is llama.cpp's record byte for
    byte, each chunk the slice of it, and the chunks joined the record again (flash attention off and on)."""
    run = Runner(engine)
    for s in range(engine.config.n_slots):
        engine.erase(s)
    run.generate(1, prompt(model, 40)[::-1], max_new_tokens=3, ignore_eos=True)
    ids = prompt(model, 700)
    assert ids and run.generate(0, ids, max_new_tokens=4, ignore_eos=True).done is not None
    run.batcher.flush()
    state = llama_state(engine.ctx, 0)
    record = record_of(state, engine.layout)
    assert seq_state.parse(state, engine.layout).layout.v_trans == (0 if engine.flash_attn else 1)
    assert bytes(read_range(engine.ctx, 0, 0, 0, WHOLE)) == record
    n = engine.seq_len(0)
    bounds = kv_chunks.chunk_bounds(n, 256)
    assert len(bounds) == 3 and bounds[-1][1] == n
    chunks = read_ranges(engine.ctx, 0, [(0, p0, p1) for p0, p1 in bounds])
    for (p0, p1), chunk in zip(bounds, chunks, strict=True):
        assert bytes(chunk) == sliced(record, p0, p1), (p0, p1)
    assert bytes(kv_chunks.join_records(chunks)) == record
    assert bytes(read_range(engine.ctx, 0, 0, 100, 101)) == sliced(record, 100, 101), "one position"
    # ranges past the sequence, empty ranges, another sequence's cells
    assert bytes(read_range(engine.ctx, 0, 0, n, n + 50)) == struct.pack("<I", 0)
    assert bytes(read_range(engine.ctx, 0, 0, 5, 5)) == struct.pack("<I", 0)
    assert bytes(read_range(engine.ctx, 0, 2, 0, WHOLE)) == struct.pack("<I", 0), "an empty sequence"
    assert bytes(read_range(engine.ctx, 0, 1, 0, WHOLE)) == record_of(llama_state(engine.ctx, 1), engine.layout)


@pytest.mark.parametrize(
    ("cache", "seq", "p0", "p1"),
    [(1, 0, 0, 10), (-1, 0, 0, 10), (0, 99, 0, 10), (0, -1, 0, 10), (0, 0, 10, 5), (0, 0, -1, 5)],
)
def test_bad_ranges_are_refused(engine: Engine, cache: int, seq: int, p0: int, p1: int) -> None:
    """A cache the model lacks, a sequence the context lacks, a reversed or negative range: refused."""
    with pytest.raises(EngineError) as err:
        read_range(engine.ctx, cache, seq, p0, p1)
    assert err.value.code == ErrorCode.INVALID_REQUEST


def test_chunks_after_a_context_shift_restore_the_sequence(engine: Engine, model: Model) -> None:
    """After a context shift the next tokens fill the hole it left (cells out of position order): the
    chunks, read in position order and joined, restore a sequence holding the same KV at each position."""
    run = Runner(engine)
    for s in range(engine.config.n_slots):
        engine.erase(s)
    ids = prompt(model, 300)
    run.generate(0, ids, max_new_tokens=2, ignore_eos=True)
    engine.context_shift(0, 10, 40)
    grown = run.generate(0, [*engine.tokens[0], *ids[5:45]], max_new_tokens=2, ignore_eos=True)
    assert grown.done is not None
    run.batcher.flush()
    positions = seq_state.parse(llama_state(engine.ctx, 0), engine.layout).positions
    assert not np.all(np.diff(positions) > 0), "the test needs cells out of position order"
    tokens = list(engine.tokens[0])
    chunks = read_ranges(engine.ctx, 0, [(0, p0, p1) for p0, p1 in kv_chunks.chunk_bounds(len(tokens), 128)])
    blob = kv_chunks.state_of([kv_chunks.join_records(chunks)])
    engine.restore_state(3, tokens, blob, check_values=True)
    want = kv_by_position(bytes(read_range(engine.ctx, 0, 0, 0, WHOLE)))
    got = kv_by_position(bytes(read_range(engine.ctx, 0, 3, 0, WHOLE)))
    assert np.array_equal(want[0], np.arange(len(tokens))) and np.array_equal(got[0], want[0])
    assert got[1] == want[1]


@pytest.mark.slow
@pytest.mark.parametrize("flash_attn", ["off", "on"])
def test_sliding_window_model_ranges(tmp_path: Path, flash_attn: str) -> None:
    """gpt-oss (window 128, two KV caches) past its window: the global cache's chunks join to its record;
    the sliding cache's whole range is its record (the cells state_write leaves out, masked by the window,
    left out too), and a range before the window holds no cells there."""
    gguf = build_tiny_gguf("gpt-oss", tmp_path)
    model = Model(gguf)
    cfg = EngineSettings(n_ctx=512, n_slots=2, n_spare=1, n_batch=64, n_ubatch=64, n_threads=2,
                         type_k="f32", type_v="f32", flash_attn=flash_attn)  # type: ignore[arg-type]  # fmt: skip
    eng = Engine(model, cfg)
    try:
        assert eng.memory.kind == "iswa" and eng.flash_attn is (flash_attn == "on")
        run = Runner(eng)
        ids = prompt(model, 400)
        assert run.generate(0, ids, max_new_tokens=3, ignore_eos=True).done is not None
        run.batcher.flush()
        state = bytes(read_state(eng.ctx, 0, shape=eng.shape)[1])  # both KV caches' parts
        n = eng.seq_len(0)
        chunks = read_ranges(eng.ctx, 0, [(0, p0, p1) for p0, p1 in kv_chunks.chunk_bounds(n, 128)])
        assert bytes(kv_chunks.join_records(chunks)) == record_of(state, eng.layout, 0)
        sliding = bytes(read_range(eng.ctx, 1, 0, 0, WHOLE))
        assert sliding == record_of(state, eng.layout, 1)
        assert kv_chunks.parse_record(sliding).n_cells < n, "the sliding cache holds the window only"
        assert bytes(read_range(eng.ctx, 1, 0, 0, 100)) == struct.pack("<I", 0)
        blob = kv_chunks.state_of([kv_chunks.join_records(chunks), sliding])
        assert bytes(blob) == state, "the state assembled from chunks is llama.cpp's, byte for byte"
    finally:
        eng.close()
        model.close()
