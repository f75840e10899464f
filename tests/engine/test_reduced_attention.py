"""Reduced attention formats (topk, spans, head subsets, sink) against the full per-layer rows of the same
generation, on the real model, with a prompt longer than one batch (n_batch 512)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from contract.options import CaptureOptions
from contract.settings import EngineSettings
from engine import native
from engine.capture import RowTarget
from engine.engine import Engine
from engine.model import Model
from tests.conftest import CHAT
from tests.engine.enginekit import Result, Runner

N_NEW = 5
ATOL = 2e-5  # the graph's mean over layers and heads vs numpy's mean of the same float32 rows


@pytest.fixture(scope="module")
def runner(engine):  # type: ignore[no-untyped-def]
    return Runner(engine)


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:  # type: ignore[no-untyped-def]
    text = " ".join(f"Box {i} holds {['red', 'green', 'blue', 'gold'][i % 4]} marbles." for i in range(90))
    ids = model.tokenize(CHAT.format(text + " Which box holds gold?"), False, True)
    assert len(ids) > 512  # more than one batch
    return ids


@pytest.fixture(scope="module")
def full(runner: Runner, prompt: list[int]) -> Result:
    """Every layer and head, float32: the reference."""
    return _run(runner, prompt, CaptureOptions(attention=True))


def _run(runner: Runner, prompt: list[int], cap: CaptureOptions) -> Result:
    """The generation of ``prompt`` on sequence 0 from an empty cache (the same cells, the same computation)."""
    runner.engine.erase(0)
    res = runner.generate(0, prompt, capture=cap, max_new_tokens=N_NEW, ignore_eos=True)
    assert res.error is None, res.error
    return res


def _same_tokens(res: Result, full: Result) -> None:
    assert res.tokens == full.tokens
    assert len(res.attention) == N_NEW


def test_topk_is_the_largest_weights_per_layer_and_head_with_their_positions(runner, prompt, full) -> None:  # type: ignore[no-untyped-def]
    layers, heads = [29, 0, 7], [8, 0, 3]
    cap = CaptureOptions(attention=True, format="topk", top_k=6, layers=layers, heads=heads, sink=4)
    res = _run(runner, prompt, cap)
    _same_tokens(res, full)
    for k, (w, pos, ref) in enumerate(zip(res.attention, res.positions, full.attention, strict=True)):
        sel = ref[layers][:, heads]  # [3, 3, n_ctx]
        assert w.shape == pos.shape == (3, 3, 6) and w.dtype == np.float32 and pos.dtype == np.int32
        want = -np.sort(-sel, axis=-1)[..., :6]
        np.testing.assert_array_equal(w, want, err_msg=f"token {k}")
        np.testing.assert_array_equal(np.take_along_axis(sel, pos.astype(np.int64), axis=-1), w)
        assert np.all(pos >= 0) and np.all(pos < len(prompt) + k)
        assert len({tuple(p) for p in pos.reshape(-1, 6)}) > 1  # heads differ
        np.testing.assert_allclose(res.events[k].sink, sel.mean(axis=(0, 1))[:4].sum(), atol=ATOL)


def test_topk_float16_and_k_above_the_context_length(runner, prompt, full) -> None:  # type: ignore[no-untyped-def]
    n = len(prompt)
    res = _run(runner, prompt, CaptureOptions(attention=True, format="topk", top_k=n + 2, dtype="float16"))
    _same_tokens(res, full)
    for k, (w, pos, ref) in enumerate(zip(res.attention, res.positions, full.attention, strict=True)):
        width = min(n + 2, n + k)  # K is capped at the token's context length
        assert w.shape == (30, 9, width) and w.dtype == np.float16
        np.testing.assert_array_equal(w, (-np.sort(-ref, axis=-1)[..., :width]).astype(np.float16))
        assert len(np.unique(pos[0, 0])) == width  # no position twice
        if width == n + k:  # K reaches the context length: every position once
            assert np.array_equal(np.sort(pos, axis=-1)[0, 0], np.arange(width))


@pytest.fixture(params=[True, False], ids=["cpu-ops", "ggml-ops"])
def cpu_ops(runner: Runner, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """How the graph selects ``topk`` and sums ``aggregated``'s heads (``llama_attn_set_cpu_ops``): with slotserve's
    CPU operators (a CPU-only model's default) or with ggml's own operators (``ggml_top_k``, a batched
    ``ggml_get_rows``: what a model with a GPU device gets)."""
    assert native.lib.llama_attn_set_cpu_ops(runner.engine.ctx, request.param) == 0
    yield request.param
    assert native.lib.llama_attn_set_cpu_ops(runner.engine.ctx, True) == 0


def test_cpu_ops_refusals() -> None:
    """No context: -1 (a model with a GPU device refuses ``true`` too: not testable on a CPU)."""
    assert native.lib.llama_attn_set_cpu_ops(None, True) == -1
    assert native.lib.llama_attn_set_cpu_ops(None, False) == -1


@pytest.mark.parametrize(
    ("top_k", "layers", "heads", "dtype"),
    [(8, None, None, "float32"), (1, [29, 0, 7], [8, 0, 3], "float16"), (64, [5], None, "float32")],
    ids=["k8", "k1-subsets-f16", "k64-one-layer"],
)
def test_topk_selected_in_the_graph_is_the_full_rows_top_k(
    runner, prompt, full, top_k, layers, heads, dtype, cpu_ops
) -> None:  # type: ignore[no-untyped-def]
    """The graph selects the top k itself (``llama_attn_max_top_k``), with either operators: the same weights as
    the full rows' largest, best first, at positions holding them; the prompt's row is a prefill chunk's gathered
    row, the others decode steps' rows read in place."""
    assert runner.engine.capture.max_top_k >= 64
    cap = CaptureOptions(attention=True, format="topk", top_k=top_k, layers=layers, heads=heads, dtype=dtype)
    assert RowTarget.of(0, 0, cap, runner.engine.attention_layers, 64).format == "topk"
    res = _run(runner, prompt, cap)
    _same_tokens(res, full)
    assert runner.engine.capture.graph_format == native.TOP_K
    for k, (w, pos, ref) in enumerate(zip(res.attention, res.positions, full.attention, strict=True)):
        sel = ref[layers or slice(None)][:, heads or slice(None)]
        assert w.shape == pos.shape == (*sel.shape[:2], top_k) and w.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(w, (-np.sort(-sel, axis=-1)[..., :top_k]).astype(dtype), err_msg=f"token {k}")
        np.testing.assert_array_equal(np.take_along_axis(sel, pos.astype(np.int64), axis=-1).astype(dtype), w)
        assert all(len(set(p)) == top_k for p in pos.reshape(-1, top_k))  # no position twice


def test_topk_in_the_graph_past_a_short_context(runner, cpu_ops) -> None:  # type: ignore[no-untyped-def]
    """k above the context length: the graph's k include cells of no position (weight 0), which become the
    positions not named yet, so every position comes once."""
    ids = runner.engine.model.tokenize("Hi", True, False)
    runner.engine.erase(0)
    ref = runner.generate(0, ids, capture=CaptureOptions(attention=True), max_new_tokens=3, ignore_eos=True)
    runner.engine.erase(0)
    res = runner.generate(0, ids, capture=CaptureOptions(attention=True, format="topk", top_k=8), max_new_tokens=3,
                          ignore_eos=True)  # fmt: skip
    assert res.tokens == ref.tokens and runner.engine.capture.graph_format == native.TOP_K
    for k, (w, pos, rows) in enumerate(zip(res.attention, res.positions, ref.attention, strict=True)):
        n = len(ids) + k
        assert w.shape == (30, 9, n)
        assert np.array_equal(np.sort(pos, axis=-1), np.broadcast_to(np.arange(n), pos.shape))
        np.testing.assert_array_equal(np.take_along_axis(rows, pos.astype(np.int64), axis=-1), w)
    runner.engine.erase(0)


def test_aggregated_in_the_graph_is_the_mean_of_the_full_rows(runner, prompt, full, cpu_ops) -> None:  # type: ignore[no-untyped-def]
    """``aggregated`` over a layer subset: the graph's mean (heads summed per layer by the CPU operator, or once
    after the last layer by ggml's ``sum_rows``) is numpy's mean of the full rows."""
    res = _run(runner, prompt, CaptureOptions(attention=True, format="aggregated", layers=[0, 14, 29]))
    _same_tokens(res, full)
    assert runner.engine.capture.graph_format == native.MEAN
    for k, (got, ref) in enumerate(zip(res.attention, full.attention, strict=True)):
        assert got.shape == (len(prompt) + k,) and got.dtype == np.float32
        np.testing.assert_allclose(got, ref[[0, 14, 29]].mean(axis=(0, 1)), atol=ATOL, err_msg=f"token {k}")


def _two(runner: Runner, prompts: tuple[list[int], list[int]], cap: CaptureOptions) -> tuple[Result, Result]:
    """``prompts`` generated on sequences 0 and 1 together (one ubatch per decode step holds both streams)."""
    for seq in (0, 1):
        runner.engine.erase(seq)
    reqs = [runner.submit(seq, p, capture=cap, max_new_tokens=N_NEW, ignore_eos=True) for seq, p in enumerate(prompts)]
    runner.run()
    for seq in (0, 1):
        runner.engine.erase(seq)
    return runner.results[reqs[0]], runner.results[reqs[1]]


def test_topk_of_two_sequences_in_one_decode(runner, prompt, cpu_ops) -> None:  # type: ignore[no-untyped-def]
    """Two sequences asking ``topk`` in the same decodes (two KV streams in each ubatch): each gets its own
    stream's top k, against the full rows of the same two generations batched the same way."""
    prompts = (prompt, prompt[:300])
    refs = _two(runner, prompts, CaptureOptions(attention=True))
    tops = _two(runner, prompts, CaptureOptions(attention=True, format="topk", top_k=4))
    assert runner.engine.capture.graph_format == native.TOP_K
    for res, ref, n in zip(tops, refs, (len(p) for p in prompts), strict=True):
        assert res.tokens == ref.tokens
        for k, (w, pos, rows) in enumerate(zip(res.attention, res.positions, ref.attention, strict=True)):
            assert w.shape == pos.shape == (30, 9, 4)
            assert np.all(pos >= 0) and np.all(pos < n + k)  # this sequence's positions, not the other's
            np.testing.assert_array_equal(w, -np.sort(-rows, axis=-1)[..., :4], err_msg=f"token {k}")
            np.testing.assert_array_equal(np.take_along_axis(rows, pos.astype(np.int64), axis=-1), w)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "n_ctx", "n_prompt"), [("gemma3", 1024, 602), ("gemma3-4b", 6144, 5000)])
def test_topk_in_the_graph_over_real_sliding_windows(tmp_path: Path, family: str, n_ctx: int, n_prompt: int) -> None:
    """Gemma 3's real windows (512 for 270M/1B, 1,024 for 4B-27B: five sliding layers to one global, two KV
    caches, the sliding one holding only the window's cells, head_dim 256, one KV head), two sequences past the
    window decoding together (the longer one past 4,000 tokens on the 4B shape), flash attention off and on, with both operator sets: each layer's graph top k
    equals its full rows' largest, bit for bit, at positions holding them; a sliding layer's all lie in its
    window (its cells come from llama.cpp's cell metadata), the global layer's reach back before it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_models import FAMILIES, build_tiny_gguf

    window = FAMILIES[family].window
    model = Model(build_tiny_gguf(family, tmp_path))
    try:
        ids = model.tokenize(" ".join(["the quick brown fox pays attention to the lazy dog"] * 500), True, False)
        prompts = (ids[:n_prompt], ids[: window // 2])  # the first past the window, longer than a batch
        assert len(prompts[0]) == n_prompt > window
        k = 16
        for fa in ("off", "on"):
            cfg = EngineSettings(n_ctx=n_ctx, n_slots=2, n_spare=0, n_threads=2, flash_attn=fa)  # type: ignore[arg-type]
            eng = Engine(model, cfg)
            run = Runner(eng)
            try:
                assert eng.shape.n_caches == 2
                windows = [eng.layer_window(il) for il in eng.attention_layers]
                assert windows == list(FAMILIES[family].windows)
                refs = _two(run, prompts, CaptureOptions(attention=True))
                for cpu_ops in (True, False):
                    assert native.lib.llama_attn_set_cpu_ops(eng.ctx, cpu_ops) == 0
                    tops = _two(run, prompts, CaptureOptions(attention=True, format="topk", top_k=k))
                    assert eng.capture.graph_format == native.TOP_K
                    for res, ref, n in zip(tops, refs, (len(p) for p in prompts), strict=True):
                        assert res.tokens == ref.tokens
                        for t, (w, pos, rows) in enumerate(
                            zip(res.attention, res.positions, ref.attention, strict=True)
                        ):
                            where = f"{fa=} {cpu_ops=} seq of {n}, token {t}"
                            assert w.shape == pos.shape == (len(windows), rows.shape[1], k)
                            np.testing.assert_array_equal(w, -np.sort(-rows, axis=-1)[..., :k], err_msg=where)
                            np.testing.assert_array_equal(np.take_along_axis(rows, pos.astype(np.int64), -1), w)
                            # the oldest position a sliding layer sees: token t's row is position n - 1 + t's
                            first = n - 1 + t - window + 1
                            for j, win in enumerate(windows):
                                if win:
                                    assert np.all(pos[j] >= max(0, first)), where
                                elif first > k:
                                    assert np.any(pos[j] < first), where  # a global layer reaches back
            finally:
                eng.close()
    finally:
        model.close()


def test_spans_sum_the_mean_row_over_each_span(runner, prompt, full) -> None:  # type: ignore[no-untyped-def]
    n = len(prompt)
    spans = [(0, 1), (1, 300), (300, 520), (n - 10, n)]
    res = _run(runner, prompt, CaptureOptions(attention=True, format="spans", spans=spans, sink=1))
    _same_tokens(res, full)
    for k, (s, ref) in enumerate(zip(res.attention, full.attention, strict=True)):
        mean = ref.mean(axis=(0, 1))
        assert s.shape == (4,) and s.dtype == np.float32
        np.testing.assert_allclose(s, [mean[a:b].sum() for a, b in spans], atol=ATOL, err_msg=f"token {k}")
        np.testing.assert_allclose(res.events[k].sink, mean[0], atol=ATOL)
        assert res.positions == []


def test_head_subsets_of_per_layer_and_aggregated(runner, prompt, full) -> None:  # type: ignore[no-untyped-def]
    res = _run(runner, prompt, CaptureOptions(attention=True, heads=[4], layers=[3, 1], dtype="float16"))
    _same_tokens(res, full)
    for got, ref in zip(res.attention, full.attention, strict=True):
        np.testing.assert_array_equal(got, ref[[3, 1]][:, [4]].astype(np.float16))
    res = _run(runner, prompt, CaptureOptions(attention=True, format="aggregated", heads=[2, 5]))
    _same_tokens(res, full)
    for got, ref in zip(res.attention, full.attention, strict=True):
        np.testing.assert_allclose(got, ref[:, [2, 5]].mean(axis=(0, 1)), atol=ATOL)


def test_a_reduced_row_beside_a_full_one_in_one_decode(runner, prompt, full) -> None:  # type: ignore[no-untyped-def]
    """Two sequences decoding together, one asking topk, one per_layer: each gets its own format."""
    for seq in (0, 1):
        runner.engine.erase(seq)
    top = runner.submit(1, prompt, capture=CaptureOptions(attention=True, format="topk", top_k=3, heads=[1]),
                        max_new_tokens=N_NEW, ignore_eos=True)  # fmt: skip
    per = runner.submit(0, prompt, capture=CaptureOptions(attention=True), max_new_tokens=N_NEW, ignore_eos=True)
    runner.run()
    a, b = runner.results[top], runner.results[per]
    assert a.tokens == b.tokens == full.tokens
    # two sequences batched together are not computed bit-equal: flash attention's side branch rounds each
    # one's rows differently, and so do the matrix kernels where a ubatch's rows take different tiles
    # (ggml-cpu's AVX-512 paths: seen up to 0.023 by layer 13 on this Q4_1 model; AVX2: bit-equal); seen up to 0.04
    atol = 0.05
    for w, pos, ref in zip(a.attention, a.positions, b.attention, strict=True):
        assert w.shape == (30, 1, 3)
        np.testing.assert_allclose(np.take_along_axis(ref[:, [1]], pos.astype(np.int64), axis=-1), w, atol=atol)
        np.testing.assert_allclose(w, -np.sort(-ref[:, [1]], axis=-1)[..., :3], atol=atol)
        assert np.all(w[..., :-1] >= w[..., 1:])  # best first
    runner.engine.erase(1)


@pytest.mark.parametrize(
    "cap",
    [
        CaptureOptions(attention=True, format="topk"),
        CaptureOptions(attention=True, format="aggregated", top_k=3),
        CaptureOptions(attention=True, heads=[9]),
        CaptureOptions(attention=True, heads=[]),
        CaptureOptions(attention=True, format="spans", spans=[(0, 5), (4, 8)]),
        CaptureOptions(attention=True, format="spans", spans=[(3, 3)]),
        CaptureOptions(attention=True, format="spans", spans=[(0, 9999)]),
        CaptureOptions(attention=True, format="spans"),
    ],
    ids=["topk-no-k", "k-aggregated", "head-9", "no-head", "overlap", "empty-span", "past-input", "no-spans"],
)
def test_the_worker_refuses_bad_reductions_and_changes_nothing(runner, prompt, cap) -> None:  # type: ignore[no-untyped-def]
    runner.engine.erase(2)
    res = runner.generate(2, prompt[:20], capture=cap)
    assert res.error is not None and res.error.refused and res.error.code == "INVALID_REQUEST"
    assert res.tokens == [] and runner.engine.seq_len(2) == 0
