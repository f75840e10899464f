"""Every model family of tests/tiny_models.py against transformers, through the slot operations, at real shapes.

Each model is built with transformers and converted by llama.cpp's own converter (``tests/tiny_models.py``):
tiny in hidden size, layers and vocabulary, real in what the engine sees (Gemma 2's 4,096-token window and
soft-capping, Gemma 3's 512 / 1,024-token windows and 5 local : 1 global layers, head_dim 256, gpt-oss's
128-token window and attention sinks, Qwen3's QK norm, LFM2's and Granite 4.0 H's layer patterns).  It then
generates greedily in our engine with flash attention on (rows from the capture's side branch) and off (rows
from the main path's softmax), f32 KV cache, ``--batch-size`` 512, with another sequence holding cells, from a
prompt longer than a batch and than the model's sliding window.  Each generated token's rows, per attention
layer and head, must correlate with transformers' eager attention over the same tokens at >= 0.9999 (a sliding
layer's row is 0 before its window in both), and the greedy tokens must be transformers' argmax:

* for the first generation;
* after the slot's state was saved and restored into another sequence (the one-stream form of every part of
  the model's memory: both KV caches of a sliding-window model, the recurrent state of a hybrid one);
* on a preview (a fork of the slot on a spare sequence);
* after a restart (the state restored into a new engine).

Every family also starts with the default settings (``slotserve serve``'s flags left out) and with
``--batch-size 64``, and answers a 2,000-token prompt.  Mamba (recurrent, no attention) checks the tokens only,
and the operations its memory cannot do are refused.  Figures: docs/models.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from contract.errors import ErrorCode
from contract.model_facts import SINK_ARCHITECTURES
from contract.options import CaptureOptions
from contract.settings import EngineSettings
from engine.engine import Engine
from engine.errors import EngineError
from engine.model import Model
from tests.engine.enginekit import Result, Runner
from tests.tiny_models import FAMILIES, NEAR_TIE, Reference, assert_matches, build_tiny_gguf

pytestmark = pytest.mark.slow

N_NEW = 5
N_BATCH = 512  # --batch-size's default
PROMPT = "the quick brown fox pays attention to the lazy dog, a model pays attention to the words"
LONG_PROMPT = 2000  # tokens of the default-settings check
MAIN_PATH_DRIFT = {("gemma2", "on"): (0.99, 0.02)}
"""(family, flash attention) -> ``(min per-head correlation, max abs difference)`` for the layers after the first,
where llama.cpp's own computation parts from transformers' float32 at the family's real shapes: Gemma 2 at
4,136 tokens with flash attention on.  llama.cpp casts K and V to F16 for flash attention
(``build_attn_mha``, src/llama-graph.cpp) and ggml-cpu's kernel sums ``softmax · V`` in an F16 accumulator
(``VKQ16``, ggml/src/ggml-cpu/ops.cpp): over 4,136 positions the first layer's *output* rounds, so every later
layer's inputs differ (measured: layer 0's rows 1.0000000, later layers 0.9973 / 0.9997 / 0.9910; the same
engine with flash attention off and an F16 KV cache: 1.0000000 everywhere; at 552 tokens flash attention on:
0.99996).  The first layer's rows stay held to the strict floor, so the capture itself is checked exactly."""


def prompt_of(model: Model, n: int) -> list[int]:
    """``n`` tokens of :data:`PROMPT` repeated (a BOS first where the model adds one)."""
    ids = model.tokenize(" ".join([PROMPT] * (n // 8 + 1)), True, False)[:n]
    assert len(ids) == n
    return ids


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory) -> tuple[str, Path, Reference]:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    gguf = build_tiny_gguf(request.param, out)
    return request.param, gguf, Reference(gguf.parent)


def check(
    ref: Reference, what: str, ids: list[int], res: Result, layers: tuple[int, ...],
    later: tuple[float, float] | None = None,
) -> float:  # fmt: skip
    """``res`` generated after ``ids`` matches transformers (:func:`tests.tiny_models.assert_matches`)."""
    assert res.error is None, (what, res.error)
    return assert_matches(ref, what, ids, res.tokens, res.attention, layers, later)


def context_of(arch: str) -> int:
    """Prompt tokens of ``arch``'s slot test: past a batch and past its sliding window."""
    return max(N_BATCH, FAMILIES[arch].window) + 40


def settings(flash_attn: str, n_ctx: int) -> EngineSettings:
    return EngineSettings(
        n_ctx=n_ctx, n_slots=2, n_spare=1, n_threads=2, type_k="f32", type_v="f32",
        flash_attn=flash_attn, verify_cells=True,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_family_matches_transformers_through_slot_ops(tiny: tuple[str, Path, Reference], flash_attn: str) -> None:
    arch, gguf, ref = tiny
    later = MAIN_PATH_DRIFT.get((arch, flash_attn))
    family = FAMILIES[arch]
    model = Model(gguf)
    n_ctx = context_of(arch) + 64
    eng = Engine(model, settings(flash_attn, n_ctx))
    worst: list[float] = []
    try:
        assert eng.flash_attn is (flash_attn == "on")
        layers = eng.attention_layers
        if family.window:
            assert eng.n_swa == family.window
            assert tuple(eng.layer_window(il) for il in range(model.n_layer)) == family.windows
        run = Runner(eng)
        prompt = prompt_of(model, context_of(arch))
        assert len(prompt) > N_BATCH and len(prompt) > family.window
        run.generate(1, prompt[::-1][:6], max_new_tokens=2)  # another sequence holds cells
        first = run.generate(0, prompt, max_new_tokens=N_NEW, ignore_eos=True)
        worst.append(check(ref, f"{arch} first", prompt, first, layers, later))
        ids = [*prompt, *first.tokens]

        # save, restore into the other sequence, go on from the restored state (one new token appended)
        tokens, state = eng.save_state(0)
        blob = bytes(state)
        assert tokens == ids
        eng.restore_state(1, tokens, blob, check_values=True)
        more = [*ids, prompt[1]]
        after = run.generate(1, more, max_new_tokens=N_NEW, ignore_eos=True)
        worst.append(check(ref, f"{arch} restored", more, after, layers, later))

        # a preview: the slot forked onto a spare, the message appended there; the slot itself unchanged
        req = run.submit(0, [], mode="preview", append=[prompt[2]], max_new_tokens=N_NEW, ignore_eos=True)
        run.run()
        worst.append(check(ref, f"{arch} preview", [*ids, prompt[2]], run.results[req], layers, later))
        assert eng.tokens[0] == ids
    finally:
        eng.close()

    # a restart: the saved state into a new engine
    eng = Engine(model, settings(flash_attn, n_ctx))
    try:
        eng.restore_state(0, tokens, blob, check_values=True)
        again = Runner(eng).generate(0, more, max_new_tokens=N_NEW, ignore_eos=True)
        worst.append(check(ref, f"{arch} restarted", more, again, layers, later))
    finally:
        eng.close()
        model.close()
    print(f"\n[{arch}, flash attention {flash_attn}] context {len(prompt)}, layers {layers}, "
          f"min per-head correlation {min(worst):.7f}")  # fmt: skip


@pytest.mark.parametrize("n_batch", [N_BATCH, 64], ids=["default", "batch-64"])
def test_family_starts_with_default_flags(tiny: tuple[str, Path, Reference], n_batch: int) -> None:
    """The engine starts with every setting at its default (``--batch-size 64`` as well: the self-check's
    prompt past the window goes in batches) and answers a 2,000-token prompt: greedy tokens, each head's row
    a distribution over the context (summing to 1, to less with attention sinks), 0 before a sliding
    layer's window, and the first row correlating with transformers' at >= 0.99 (f16 KV cache)."""
    arch, gguf, ref = tiny
    family = FAMILIES[arch]
    model = Model(gguf)
    eng = Engine(model, EngineSettings(n_batch=n_batch))
    try:
        assert eng.config.n_ctx == 4096 and eng.config.n_batch == n_batch
        prompt = prompt_of(model, LONG_PROMPT)
        res = Runner(eng).generate(0, prompt, max_new_tokens=3, ignore_eos=True)
        assert res.error is None, res.error
        assert len(res.tokens) == 3 and res.done is not None and res.done.n_prefilled == LONG_PROMPT
        layers = eng.attention_layers
        assert len(res.attention) == (3 if layers else 0)
        sinks = model.meta("general.architecture") in SINK_ARCHITECTURES
        for k, rows in enumerate(res.attention):
            n = LONG_PROMPT + k
            assert rows.shape == (len(layers), model.n_head, n)
            sums = rows.sum(axis=-1)
            assert np.all(sums <= 1 + 1e-3) and (sinks or np.allclose(sums, 1.0, atol=1e-3)), (arch, sums)
            for j, il in enumerate(layers):
                window = eng.layer_window(il)
                if window:
                    assert window == family.windows[il] and np.all(rows[j, :, : n - window] == 0), (arch, il)
        want, logits = ref(prompt, first=LONG_PROMPT - 1)
        if layers:
            assert want is not None
            got = res.attention[0]
            corr = min(
                float(np.corrcoef(got[j, h], want[j, h, 0])[0, 1])
                for j in range(len(layers))
                for h in range(model.n_head)
            )
            assert corr >= 0.99, (arch, corr)
            print(f"\n[{arch}, defaults, batch {n_batch}] 2,000 tokens: min per-head correlation {corr:.5f}")
        else:  # no KV cache to hold in f16: the recurrent model's first token is transformers' argmax (or a near-tie)
            assert logits[-1].max() - logits[-1, res.tokens[0]] <= NEAR_TIE, arch
    finally:
        eng.close()
        model.close()


def test_sliding_window_cache_past_its_cells(tmp_path: Path) -> None:
    """gpt-oss past the 256 cells of its sliding-window cache (llama.cpp pads ``n_swa + n_ubatch`` to 256), so
    that cell holds a later position than it did: the local layers' (even ones) rows are 0 before the window
    and match transformers, the global layers' do not end there; a prefix cut within the window is kept, one
    cut further back is prefilled again (those positions' sliding-cache cells are gone) and still matches;
    context shift is refused (llama.cpp cannot shift two caches of different sizes), the slot unchanged."""
    gguf = build_tiny_gguf("gpt-oss", tmp_path)
    ref = Reference(gguf.parent)
    model = Model(gguf)
    window = FAMILIES["gpt-oss"].window
    cfg = EngineSettings(n_ctx=512, n_slots=1, n_spare=1, n_batch=32, n_ubatch=32, n_threads=2,
                         type_k="f32", type_v="f32", flash_attn="off", verify_cells=True)  # type: ignore[arg-type]  # fmt: skip
    eng = Engine(model, cfg)
    try:
        assert eng.memory.kind == "iswa" and eng.n_swa == window
        assert [eng.layer_window(il) for il in eng.attention_layers] == [window, 0, window, 0]
        run = Runner(eng)
        long = prompt_of(model, 400)
        res = run.generate(0, long, max_new_tokens=3, ignore_eos=True)
        check(ref, "gpt-oss long", long, res, eng.attention_layers)
        for k, rows in enumerate(res.attention):
            before = len(long) + k - window
            assert np.all(rows[[0, 2], :, :before] == 0) and np.all(rows[[1, 3], :, :before] > 0)
        # the graph's reductions over both caches: top k (positions from each cache's own cells) and the mean
        for cap in (
            CaptureOptions(attention=True, format="topk", top_k=5),
            CaptureOptions(attention=True, format="aggregated"),
        ):
            eng.erase(0)
            red = run.generate(0, long, capture=cap, max_new_tokens=3, ignore_eos=True)
            assert red.tokens == res.tokens
            for k, (got, rows) in enumerate(zip(red.attention, res.attention, strict=True)):
                if cap.format == "aggregated":
                    np.testing.assert_allclose(got, rows.mean(axis=(0, 1)), atol=2e-5, err_msg=f"token {k}")
                    continue
                np.testing.assert_array_equal(got, -np.sort(-rows, axis=-1)[..., :5], err_msg=f"token {k}")
                pos = red.positions[k].astype(np.int64)
                np.testing.assert_array_equal(np.take_along_axis(rows, pos, axis=-1), got)
        n = eng.seq_len(0)
        assert eng.can_keep(0, n - 3) and not eng.can_keep(0, 100)
        assert not eng.memory.can_shift
        with pytest.raises(EngineError) as err:
            eng.context_shift(0, 4, 10)
        assert err.value.code == ErrorCode.INVALID_REQUEST and eng.seq_len(0) == n
        cut = [*long[:100], long[5]]
        again = run.generate(0, cut, max_new_tokens=3, ignore_eos=True)
        check(ref, "gpt-oss cut back", cut, again, eng.attention_layers)
        assert again.done is not None and again.done.n_cached == 0, "the sliding cache no longer held the window"
    finally:
        eng.close()
        model.close()


def test_recurrent_state_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    """A recurrent state holds the whole sequence at its last position: cutting it earlier and shifting it
    are refused with the model's limitation named, the sequence unchanged; continuing with a diverging
    prompt prefills it again (as llama-server does), and a fork is a copy the slot does not see."""
    gguf = build_tiny_gguf("mamba", tmp_path)
    model = Model(gguf)
    eng = Engine(model, settings("off", 256))
    try:
        assert eng.memory.kind == "recurrent" and eng.attention_layers == ()
        run = Runner(eng)
        prompt = model.tokenize(PROMPT, True, False)
        first = run.generate(0, prompt, max_new_tokens=3, ignore_eos=True)
        ids = [*prompt, *first.tokens]
        before = bytes(eng.save_state(0)[1])
        for op in (lambda: eng.truncate(0, 4), lambda: eng.context_shift(0, 2, 3)):
            with pytest.raises(EngineError) as err:
                op()
            assert err.value.code == ErrorCode.INVALID_REQUEST and "recurrent" in err.value.message
            assert eng.tokens[0] == ids and bytes(eng.save_state(0)[1]) == before
        req = run.submit(0, [], mode="preview", append=[prompt[2]], max_new_tokens=3, ignore_eos=True)
        run.run()
        assert run.results[req].error is None and eng.tokens[0] == ids
        assert bytes(eng.save_state(0)[1]) == before, "the preview's fork changed the slot's state"
        diverged = [*prompt[:4], prompt[1]]
        res = run.generate(0, diverged, max_new_tokens=3, ignore_eos=True)
        ref = Reference(gguf.parent)
        check(ref, "mamba diverged", diverged, res, ())
    finally:
        eng.close()
        model.close()
