"""llama-server's automatic context shift (``--context-shift``): a generation that fills its window drops
half of the tokens after the kept start and goes on (``engine/batcher.py``, ``Batcher._room``).

The window is the engine's ``n_ctx`` (here set small on the shared engine: the shift's rule reads only
the setting, the cells are llama.cpp's).  Checked on the real model: the generation runs past the
window, every token's attention row covers exactly the tokens the slot holds after the shifts reported
so far (``Token.shift``), the slot ends as ``prompt[:n_keep]`` + what was not dropped, its KV state has
positions ``0..n-1``, and without ``--context-shift`` the same request is refused unchanged.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from contract.errors import ErrorCode
from contract.options import CaptureOptions
from slotstate import seq_state
from tests.engine.enginekit import Result, Runner

WINDOW = 64
SEQ = 0


@pytest.fixture
def shifting(engine, monkeypatch):  # type: ignore[no-untyped-def]
    """The shared engine with ``--context-shift`` on and a window of ``WINDOW`` tokens."""
    engine.erase(SEQ)
    monkeypatch.setattr(engine, "config", msgspec.structs.replace(engine.config, context_shift=True, n_ctx=WINDOW))
    yield engine
    engine.erase(SEQ)


def replay(prompt: list[int], res: Result) -> list[int]:
    """The slot's tokens as the events describe them, checking each token's attention length on the way."""
    ctx = list(prompt)
    for i, ev in enumerate(res.events):
        if ev.shift is not None:
            n_keep, n_discard = ev.shift
            del ctx[n_keep : n_keep + n_discard]
        if i:
            ctx.append(res.tokens[i - 1])  # decoded after the shift, its row comes with this event
        assert ev.n_ctx == len(ctx) == res.attention[i].shape[-1], f"token {i}"
    return [*ctx, res.tokens[-1]]  # the last token is written at the next step (a commit)


def test_generation_shifts_past_its_window(shifting, model) -> None:  # type: ignore[no-untyped-def]
    prompt = model.tokenize("<|im_start|>user\nCount slowly from one to one hundred.<|im_end|>\n", True, True)
    run = Runner(shifting)
    res = run.generate(SEQ, prompt, max_new_tokens=100, ignore_eos=True)  # prompt + 100 > 64
    assert res.error is None and res.done is not None
    assert len(res.tokens) == res.done.n_generated == 100
    shifts = [ev.shift for ev in res.events if ev.shift is not None]
    assert len(shifts) >= 2, "100 tokens past a 64-token window shift it more than once"
    assert all(k == 0 for k, _ in shifts)  # n_keep 0 (llama-server's default); SmolLM2 adds no BOS
    assert res.done.truncated and res.done.n_discarded == sum(d for _, d in shifts)
    run.batcher.flush(SEQ)
    assert shifting.tokens[SEQ] == replay(prompt, res)
    assert len(shifting.tokens[SEQ]) < WINDOW
    assert res.done.seq_tokens == len(shifting.tokens[SEQ])
    _, state = shifting.save_state(SEQ)
    positions = seq_state.parse(state, shifting.layout).positions
    np.testing.assert_array_equal(np.sort(positions), np.arange(len(shifting.tokens[SEQ])))
    print(f"\nshifts (n_keep, n_discard): {shifts}; slot {len(shifting.tokens[SEQ])} tokens")


def test_topk_positions_follow_the_cells_through_shifts(shifting, model) -> None:  # type: ignore[no-untyped-def]
    """``topk`` selected in the graph past the window: each shift takes cells out of position order and the next
    tokens fill the holes it left, so the graph's cells become positions through the mirror's inverse as it changes
    (``CellMap.positions``): every token's k weights are its full row's largest, at the positions holding them."""
    prompt = model.tokenize("<|im_start|>user\nCount slowly from one to one hundred.<|im_end|>\n", True, True)
    full = Runner(shifting).generate(SEQ, prompt, max_new_tokens=100, ignore_eos=True)
    shifting.erase(SEQ)
    cap = CaptureOptions(attention=True, format="topk", top_k=4)
    top = Runner(shifting).generate(SEQ, prompt, max_new_tokens=100, ignore_eos=True, capture=cap)
    assert top.error is None and top.tokens == full.tokens
    assert sum(ev.shift is not None for ev in top.events) >= 2
    for i, (w, pos, rows) in enumerate(zip(top.attention, top.positions, full.attention, strict=True)):
        assert w.shape == pos.shape == (*rows.shape[:2], 4)
        np.testing.assert_array_equal(w, -np.sort(-rows, axis=-1)[..., :4], err_msg=f"token {i}")
        np.testing.assert_array_equal(np.take_along_axis(rows, pos.astype(np.int64), axis=-1), w, err_msg=f"token {i}")


def test_n_keep_keeps_the_prompt(shifting, model) -> None:  # type: ignore[no-untyped-def]
    prompt = model.tokenize("<|im_start|>system\nYou are a counting machine.<|im_end|>\n", True, True)
    run = Runner(shifting)
    res = run.generate(SEQ, prompt, max_new_tokens=80, ignore_eos=True, n_keep=-1)  # -1: the whole prompt
    assert res.error is None and res.done is not None and res.done.truncated
    shifts = [ev.shift for ev in res.events if ev.shift is not None]
    assert shifts and all(k == len(prompt) for k, _ in shifts)
    run.batcher.flush(SEQ)
    assert shifting.tokens[SEQ][: len(prompt)] == prompt
    assert shifting.tokens[SEQ] == replay(prompt, res)


def test_without_context_shift_the_window_bounds_a_request(engine, model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(engine, "config", msgspec.structs.replace(engine.config, context_shift=False, n_ctx=WINDOW))
    engine.erase(SEQ)
    prompt = model.tokenize("<|im_start|>user\nHello<|im_end|>\n", True, True)
    run = Runner(engine)
    run.generate(SEQ, prompt, max_new_tokens=4)
    before = list(engine.tokens[SEQ])
    res = run.generate(SEQ, prompt, max_new_tokens=WINDOW)
    assert res.error is not None and res.error.code is ErrorCode.CONTEXT_OVERFLOW and res.error.refused
    assert engine.tokens[SEQ] == before
    fits = run.generate(SEQ, prompt, max_new_tokens=WINDOW - len(prompt), ignore_eos=True)
    assert fits.done is not None and fits.done.truncated and not fits.done.n_discarded  # ended at the window
    engine.erase(SEQ)


def test_a_prompt_that_fills_the_window_is_refused(shifting, model) -> None:  # type: ignore[no-untyped-def]
    res = Runner(shifting).generate(SEQ, [model.bos if model.bos >= 0 else 1] * WINDOW, max_new_tokens=4)
    assert res.error is not None and res.error.code is ErrorCode.CONTEXT_OVERFLOW and res.error.refused
