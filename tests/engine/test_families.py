"""Every model family of tests/tiny_models.py against transformers, through the slot operations.

Each model is built with transformers and converted by llama.cpp's own converter (``tests/tiny_models.py``),
then generates greedily in our engine with flash attention on (rows from the capture's side branch) and off
(rows from the main path's softmax), f32 KV cache, with another sequence holding cells, from a prompt longer
than the sliding window of Gemma 2 / Gemma 3.  Each generated token's rows, per attention layer and head, must
correlate with transformers' eager attention over the same tokens at >= 0.9999 (measured: 0.999999+; a
sliding layer's row is 0 before its window in both), and the greedy tokens must be transformers' argmax:

* for the first generation;
* after the slot's state was saved and restored into another sequence (the one-stream form of every part of
  the model's memory: both KV caches of a sliding-window model, the recurrent state of a hybrid one);
* on a preview (a fork of the slot on a spare sequence);
* after a restart (the state restored into a new engine).

Mamba (recurrent, no attention) checks the tokens only, and the operations its memory cannot do are refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from contract.errors import ErrorCode
from contract.settings import EngineSettings
from engine.engine import Engine, EngineError
from engine.model import Model
from tests.engine.enginekit import Result, Runner
from tests.tiny_models import ARCHITECTURES, SLIDING_WINDOW, Reference, assert_matches, build_tiny_gguf

pytestmark = pytest.mark.slow

N_NEW = 5
PROMPT = "the quick brown fox pays attention to the lazy dog, a model pays attention to the words"


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny(request, tmp_path_factory) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, build_tiny_gguf(request.param, out)


def check(ref: Reference, what: str, ids: list[int], res: Result, layers: tuple[int, ...]) -> float:
    """``res`` generated after ``ids`` matches transformers (:func:`tests.tiny_models.assert_matches`)."""
    assert res.error is None, (what, res.error)
    return assert_matches(ref, what, ids, res.tokens, res.attention, layers)


def settings(flash_attn: str) -> EngineSettings:
    return EngineSettings(
        n_ctx=256, n_slots=2, n_spare=1, n_threads=2, type_k="f32", type_v="f32",
        flash_attn=flash_attn, verify_cells=True,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_family_matches_transformers_through_slot_ops(tiny: tuple[str, Path], flash_attn: str) -> None:
    arch, gguf = tiny
    ref = Reference(gguf.parent)
    model = Model(gguf)
    eng = Engine(model, settings(flash_attn))
    worst: list[float] = []
    try:
        assert eng.flash_attn is (flash_attn == "on")
        layers = eng.attention_layers
        run = Runner(eng)
        prompt = model.tokenize(PROMPT, True, False)
        assert len(prompt) > SLIDING_WINDOW + 2
        run.generate(1, prompt[::-1][:6], max_new_tokens=2)  # another sequence holds cells
        first = run.generate(0, prompt, max_new_tokens=N_NEW, ignore_eos=True)
        worst.append(check(ref, f"{arch} first", prompt, first, layers))
        ids = [*prompt, *first.tokens]

        # save, restore into the other sequence, go on from the restored state (one new token appended)
        tokens, state = eng.save_state(0)
        blob = bytes(state)
        assert tokens == ids
        eng.restore_state(1, tokens, blob, check_values=True)
        more = [*ids, prompt[1]]
        after = run.generate(1, more, max_new_tokens=N_NEW, ignore_eos=True)
        worst.append(check(ref, f"{arch} restored", more, after, layers))

        # a preview: the slot forked onto a spare, the message appended there; the slot itself unchanged
        req = run.submit(0, [], mode="preview", append=[prompt[2]], max_new_tokens=N_NEW, ignore_eos=True)
        run.run()
        worst.append(check(ref, f"{arch} preview", [*ids, prompt[2]], run.results[req], layers))
        assert eng.tokens[0] == ids
    finally:
        eng.close()

    # a restart: the saved state into a new engine
    eng = Engine(model, settings(flash_attn))
    try:
        eng.restore_state(0, tokens, blob, check_values=True)
        again = Runner(eng).generate(0, more, max_new_tokens=N_NEW, ignore_eos=True)
        worst.append(check(ref, f"{arch} restarted", more, again, layers))
    finally:
        eng.close()
        model.close()
    print(f"\n[{arch}, flash attention {flash_attn}] layers {layers}, min per-head correlation {min(worst):.7f}")


def test_sliding_window_cache_past_its_cells(tmp_path: Path) -> None:
    """Gemma 2 past the 256 cells of its sliding-window cache (llama.cpp pads ``n_swa + n_ubatch`` to 256), so
    that cell holds a later position than it did: the local layers' (even ones) rows are 0 before the window
    and match transformers, the global layers' do not end there; a prefix cut within the window is kept, one
    cut further back is prefilled again (those positions' sliding-cache cells are gone) and still matches;
    context shift is refused (llama.cpp cannot shift two caches of different sizes), the slot unchanged."""
    gguf = build_tiny_gguf("gemma2", tmp_path)
    ref = Reference(gguf.parent)
    model = Model(gguf)
    cfg = EngineSettings(n_ctx=512, n_slots=1, n_spare=1, n_batch=32, n_ubatch=32, n_threads=2,
                         type_k="f32", type_v="f32", flash_attn="off", verify_cells=True)  # type: ignore[arg-type]  # fmt: skip
    eng = Engine(model, cfg)
    try:
        assert eng.memory.kind == "iswa" and eng.n_swa == SLIDING_WINDOW
        assert [eng.layer_window(il) for il in eng.attention_layers] == [SLIDING_WINDOW, 0, SLIDING_WINDOW, 0]
        run = Runner(eng)
        long = model.tokenize(" ".join([PROMPT] * 30), True, False)[:400]
        res = run.generate(0, long, max_new_tokens=3, ignore_eos=True)
        check(ref, "gemma2 long", long, res, eng.attention_layers)
        for k, rows in enumerate(res.attention):
            before = len(long) + k - SLIDING_WINDOW
            assert np.all(rows[[0, 2], :, :before] == 0) and np.all(rows[[1, 3], :, :before] > 0)
        n = eng.seq_len(0)
        assert eng.can_keep(0, n - 3) and not eng.can_keep(0, 100)
        assert not eng.memory.can_shift
        with pytest.raises(EngineError) as err:
            eng.context_shift(0, 4, 10)
        assert err.value.code == ErrorCode.INVALID_REQUEST and eng.seq_len(0) == n
        cut = [*long[:100], long[5]]
        again = run.generate(0, cut, max_new_tokens=3, ignore_eos=True)
        check(ref, "gemma2 cut back", cut, again, eng.attention_layers)
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
    eng = Engine(model, settings("off"))
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
