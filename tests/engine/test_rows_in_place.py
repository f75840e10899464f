"""Decode steps' attention rows read in place (libllama/llama-attn.h, ``llama_attn_set_in_place``).

A ubatch with one token per KV stream, in the per-layer format, takes each selected layer's post-softmax tensor
as its graph output (no gather, no copy into one tensor) and, on this CPU backend, the rows are read straight
from those tensors after ``llama_decode`` (``llama_attn_row.in_place``).  Prefill chunks keep the gather path.
The same decodes with in-place reading switched off (the gather path for every ubatch) are the reference: the
rows must be equal exactly, in float32 and float16 (a cast of the same values), with flash attention off (kq
itself) and on (the recomputed rows), for several sequences of different lengths decoding together, after a
prefill longer than a batch, with a prefill chunk in the same ``llama_decode`` (the decode step's ubatch is not
the last: its rows are copied), when capture and in-place reading switch between decodes (graph reuse), and on
a Gemma-3-shaped model with sliding-window layers (two KV caches).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest

from contract.options import CaptureOptions
from contract.settings import EngineSettings
from engine import native
from engine.batch import BatchEntry
from engine.engine import Engine
from engine.model import Model
from tests.conftest import CHAT

FORMATS = {
    "f32": CaptureOptions(attention=True),
    "f16": CaptureOptions(attention=True, dtype="float16"),
    "f32-layers": CaptureOptions(attention=True, layers=[29, 3, 11]),
}


@pytest.fixture()
def prompt(model: Model) -> list[int]:
    return model.tokenize(CHAT.format("Name three colours of the rainbow."), False, True)


@pytest.fixture()
def clean(engine: Engine) -> Iterator[Engine]:
    for s in range(engine.config.n_slots):
        engine.erase(s)
    yield engine
    assert native.lib.llama_attn_set_in_place(engine.ctx, True) == 0
    for s in range(engine.config.n_slots):
        engine.erase(s)


def row_in_place(engine: Engine, i: int = 0, cache: int = 0) -> bool:
    """Whether row ``i`` of the last decode was read from the graph's own outputs."""
    row = native.AttnRow()
    assert native.lib.llama_attn_get_row(engine.ctx, i, cache, ctypes.byref(row)) == 0
    return bool(row.in_place)


def steps(
    engine: Engine, prompts: list[list[int]], n_steps: int, cap: CaptureOptions, in_place: bool
) -> tuple[list[np.ndarray], list[bool]]:
    """Prefill each prompt on its own sequence (batches of ``n_batch``, the last token's row captured), then
    ``n_steps`` decodes of one token per sequence, all sequences in one ``llama_decode``, every row captured.
    Returns the rows in order (prefill rows first) and, per decode step, whether its first row was read in place
    (in every KV cache)."""
    assert native.lib.llama_attn_set_in_place(engine.ctx, in_place) == 0
    rows: list[np.ndarray] = []
    for s, p in enumerate(prompts):
        engine.erase(s)
        t = engine.new_target(s, len(p) - 1, cap)
        assert engine.decode_in_batches(BatchEntry(s, 0, p, logits=True, target=t)) == 0
        assert t.out is not None
        rows.append(t.out.copy())
    flags = []
    for k in range(n_steps):
        entries = []
        for s, p in enumerate(prompts):
            pos = len(p) + k
            entries.append(BatchEntry(s, pos, [p[k % len(p)]], logits=True, target=engine.new_target(s, pos, cap)))
        assert engine.decode(entries) == 0
        flags.append(all(row_in_place(engine, 0, c) for c in range(engine.shape.n_caches)))
        for e in entries:
            assert e.target is not None and e.target.out is not None
            rows.append(e.target.out.copy())
    return rows, flags


def assert_same_rows(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b), (k, float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_decode_steps_in_place_equal_the_gather_path(clean: Engine, prompt: list[int], fmt: str) -> None:
    """Three sequences of different lengths (the shorter streams' rows end in masked cells) decode together."""
    prompts = [prompt, prompt[:7], [*prompt, *prompt[::-1]]]
    cap = FORMATS[fmt]
    got, flags = steps(clean, prompts, 4, cap, in_place=True)
    want, ref_flags = steps(clean, prompts, 4, cap, in_place=False)
    assert flags == [True] * 4 and ref_flags == [False] * 4
    assert_same_rows(got, want)
    n_layers = len(cap.layers) if cap.layers is not None else len(clean.attention_layers)
    for k, r in enumerate(got[len(prompts) :]):
        n_ctx = len(prompts[k % len(prompts)]) + k // len(prompts) + 1
        assert r.shape == (n_layers, 9, n_ctx)
        np.testing.assert_allclose(r.astype(np.float32).sum(axis=-1), 1.0, atol=2e-3)


def test_a_prefill_longer_than_a_batch_then_decode_steps(clean: Engine, prompt: list[int]) -> None:
    long = (prompt * (clean.config.n_batch // len(prompt) + 2))[: clean.config.n_batch + 60]
    prompts = [long, prompt]
    got, flags = steps(clean, prompts, 3, FORMATS["f32"], in_place=True)
    want, _ = steps(clean, prompts, 3, FORMATS["f32"], in_place=False)
    assert all(flags)
    assert_same_rows(got, want)


def test_a_decode_step_beside_a_prefill_chunk_in_one_decode(clean: Engine, prompt: list[int]) -> None:
    """Sequence 0 decodes one token while sequence 1 prefills 12 in the same ``llama_decode``: llama.cpp splits
    them into ubatches, and a one-token-per-stream ubatch that is not the decode's last is copied out before the
    next ubatch computes in the same buffers."""
    cap = FORMATS["f32"]
    out, flags = {}, {}
    for in_place in (True, False):
        assert native.lib.llama_attn_set_in_place(clean.ctx, in_place) == 0
        clean.erase(0)
        clean.erase(1)
        assert clean.decode([BatchEntry(0, 0, prompt, logits=True)]) == 0
        a = clean.new_target(0, len(prompt), cap)
        b = clean.new_target(1, 11, cap)
        assert (
            clean.decode([BatchEntry(0, len(prompt), [prompt[0]], True, a), BatchEntry(1, 0, prompt[:12], True, b)])
            == 0
        )
        assert a.out is not None and b.out is not None
        out[in_place] = [a.out.copy(), b.out.copy()]
        flags[in_place] = row_in_place(clean, 0)
    assert flags == {True: False, False: False}, "the decode step's ubatch is followed by the chunk's: copied"
    assert_same_rows(out[True], out[False])


def test_switching_capture_and_in_place_between_decodes(clean: Engine, prompt: list[int]) -> None:
    """Decodes alternate capturing and not, and in-place reading flips on and off: each switch of the way rows
    are read builds another graph (llama.cpp reuses none across it), and the rows equal the gather path's."""
    ctx = clean.ctx
    assert clean.decode([BatchEntry(0, 0, prompt, logits=True)]) == 0
    pos = len(prompt)
    rows: dict[bool, list[np.ndarray]] = {True: [], False: []}
    for k in range(8):
        for in_place in (True, False):  # the same step computed both ways, then the token kept once
            assert native.lib.llama_attn_set_in_place(ctx, in_place) == 0
            reused = llama.llama_perf_context(ctx).n_reused
            t = clean.new_target(0, pos, FORMATS["f32"]) if k % 2 == 0 else None
            assert clean.decode([BatchEntry(0, pos, [prompt[k]], logits=True, target=t)]) == 0
            if t is not None:
                assert t.out is not None
                assert row_in_place(clean) is in_place
                rows[in_place].append(t.out.copy())
                assert llama.llama_perf_context(ctx).n_reused == reused, f"step {k}: a graph reused across the switch"
            if in_place:
                clean.truncate(0, pos)  # computed again the other way
        pos += 1
    assert len(rows[True]) == 4
    assert_same_rows(rows[True], rows[False])


def test_bad_arguments_are_refused() -> None:
    assert native.lib.llama_attn_set_in_place(None, True) == -1


@pytest.mark.slow
def test_sliding_window_layers_in_place(tmp_path: Path) -> None:
    """Gemma 3's shape (5 sliding layers to 1 global: two KV caches, the sliding one holding only the window's
    cells) past its 512-token window, two sequences decoding together, flash attention off and on."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_models import build_tiny_gguf

    model = Model(build_tiny_gguf("gemma3", tmp_path))
    try:
        ids = model.tokenize(" ".join(["the quick brown fox pays attention to the lazy dog"] * 70), True, False)
        prompts = [ids[:560], ids[:300]]
        for fa in ("off", "on"):
            eng = Engine(model, EngineSettings(n_ctx=1024, n_slots=2, n_spare=0, n_threads=2, flash_attn=fa))  # type: ignore[arg-type]
            try:
                assert eng.shape.n_caches == 2
                for cap in (CaptureOptions(attention=True), CaptureOptions(attention=True, dtype="float16")):
                    got, flags = steps(eng, prompts, 3, cap, in_place=True)
                    want, _ = steps(eng, prompts, 3, cap, in_place=False)
                    assert all(flags)  # both KV caches' rows
                    assert_same_rows(got, want)
                    first_global = got[len(prompts)][eng.attention_layers.index(5)]
                    assert np.all(first_global[:, :10] > 0), "the global layer sees the first positions"
                    assert np.all(got[len(prompts)][0][:, :10] == 0), "a sliding layer's row is 0 before its window"
            finally:
                eng.close()
    finally:
        model.close()


def test_rows_are_recycled_once_let_go_and_never_while_read(clean: Engine, prompt: list[int]) -> None:
    """A token's full rows (megabytes at long contexts) go to a recycled buffer (engine/capture.py): once the
    worker has written a token's rows and let go of them, the next token's land in the same memory instead of
    fresh pages; rows still read (here: kept by the test, as a slow reader would) are never written over."""
    cap = FORMATS["f32"]
    assert clean.decode([BatchEntry(0, 0, prompt, logits=True)]) == 0

    def step(k: int) -> np.ndarray:
        pos = len(prompt) + k
        t = clean.new_target(0, pos, cap)
        assert clean.decode([BatchEntry(0, pos, [prompt[k % len(prompt)]], logits=True, target=t)]) == 0
        assert t.out is not None and t.out.shape == (len(clean.attention_layers), 9, pos + 1)
        np.testing.assert_allclose(t.out.sum(axis=-1), 1.0, atol=2e-3)
        return t.out

    kept = step(0)
    kept_copy = kept.copy()
    seen: list[weakref.ref[object]] = []  # the pool's buffers under each token's rows (weak: not a view)
    reused = 0
    for k in range(1, 6):
        rows = step(k)
        assert rows.ctypes.data != kept.ctypes.data
        base: object = rows
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview)
        reused += any(r() is base.obj for r in seen)
        seen.append(weakref.ref(base.obj))
        del rows, base  # written out: let go
    assert np.array_equal(kept, kept_copy), "rows still read were written over"
    assert reused >= 3, f"only {reused} of 5 tokens' rows landed in a buffer let go before"
