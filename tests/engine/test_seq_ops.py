"""KV sequence operations on the real model: state save/restore, forks, context shift, batching."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.errors import EngineError
from slotstate import seq_state
from tests.conftest import CHAT
from tests.engine.enginekit import Runner, assert_attention_close, llama_state, prefill_row, same_kv


@pytest.fixture(scope="module")
def runner(engine):  # type: ignore[no-untyped-def]
    for s in range(engine.config.n_slots):
        engine.erase(s)
    return Runner(engine)


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:  # type: ignore[no-untyped-def]
    return model.tokenize(CHAT.format("Tell me a short fact about owls."), False, True)


def test_state_round_trip_into_another_sequence(runner: Runner, engine, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    runner.generate(0, prompt, max_new_tokens=6, ignore_eos=True)
    runner.batcher.flush()
    tokens, blob = engine.save_state(0)
    assert tokens == engine.tokens[0] and len(tokens) == len(prompt) + 6
    parsed = seq_state.parse(blob, engine.layout)
    assert sorted(parsed.positions.tolist()) == list(range(len(tokens)))
    engine.erase(2)
    engine.restore_state(1, tokens, blob)
    assert engine.tokens[1] == tokens
    # both continue identically
    follow = tokens + engine.model.tokenize("\nMore:", False, False)
    a = runner.generate(0, follow, max_new_tokens=8, ignore_eos=True)
    b = runner.generate(1, follow, max_new_tokens=8, ignore_eos=True)
    assert a.tokens == b.tokens
    assert a.done.n_cached == b.done.n_cached == len(tokens)
    for k, (x, y) in enumerate(zip(a.attention, b.attention, strict=True)):
        assert_attention_close(x, y, f"token {k}")


@pytest.mark.parametrize(
    "damage",
    ["magic", "truncate", "extra", "layers", "cells", "positions", "tokens_len", "vocab"],
)
def test_bad_states_are_refused_and_leave_the_target_alone(runner: Runner, engine, prompt, damage: str) -> None:  # type: ignore[no-untyped-def]
    engine.erase(0)
    engine.erase(1)
    runner.generate(0, prompt, max_new_tokens=2, ignore_eos=True)
    runner.batcher.flush()
    tokens, blob = engine.save_state(0)
    runner.generate(1, prompt[:5], max_new_tokens=1)
    runner.batcher.flush()
    before = (list(engine.tokens[1]), engine.cellmap.cells(1).copy(), engine.save_state(1)[1])
    b = bytearray(blob)
    toks = list(tokens)
    if damage == "magic":
        b[0] ^= 0xFF
    elif damage == "truncate":
        b = b[: len(b) // 2]
    elif damage == "extra":
        b += b"\0" * 16
    elif damage == "layers":  # the state of a model with another layer count
        off = 4 + 4 + 4 + 4 + 12 * len(tokens) + 4
        struct.pack_into("<I", b, off, 29)
    elif damage == "cells":
        struct.pack_into("<I", b, 12, len(tokens) + 3)
    elif damage == "positions":
        struct.pack_into("<i", b, 16, 5000)
    elif damage == "tokens_len":
        toks = toks[:-1]
    elif damage == "vocab":
        toks[0] = engine.model.n_vocab + 5
    with pytest.raises(EngineError) as err:
        engine.restore_state(1, toks, bytes(b))
    assert err.value.code == "BAD_STATE"
    after = (list(engine.tokens[1]), engine.cellmap.cells(1).copy(), engine.save_state(1)[1])
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2] == before[2]


def test_context_shift_then_generate(runner: Runner, engine, model, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine.erase(0)
    long = prompt + model.tokenize(" The owl is a bird of prey." * 6, False, False)
    runner.generate(0, long, max_new_tokens=4, ignore_eos=True)
    runner.batcher.flush()
    n = engine.seq_len(0)
    kept = engine.tokens[0][:5] + engine.tokens[0][5 + 20 :]
    assert engine.context_shift(0, 5, 20) == n - 20
    assert engine.tokens[0] == kept
    res = runner.generate(0, kept, max_new_tokens=4, ignore_eos=True)
    assert res.done.n_cached == len(kept) - 1  # only the last token is recomputed for its logits
    assert res.attention[0].shape[-1] == len(kept)
    # A RoPE shift was applied to the kept tail: compare with a fresh prefill of the kept tokens
    # with the cell-layout tolerance (documented in enginekit; RoPE-shifted keys differ by float rounding).
    want = prefill_row(engine, 3, kept)
    diff = np.abs(res.attention[0] - want)
    assert diff.mean() < 5e-3 and diff[0].max() < 1e-3, (diff.mean(), diff[0].max())


@pytest.mark.parametrize("bad", [(-1, 5), (0, 0), (3, 10_000)])
def test_context_shift_constraints(engine, bad: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineError) as err:
        engine.context_shift(0, *bad)
    assert err.value.code == "INVALID_REQUEST"


def test_a_fork_copies_the_stream_and_shifting_it_leaves_the_source(runner: Runner, engine, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine.erase(0)
    engine.erase(1)
    runner.generate(0, prompt, max_new_tokens=4, ignore_eos=True)
    runner.batcher.flush()
    engine.fork(0, 1)
    np.testing.assert_array_equal(engine.cellmap.cells(0), engine.cellmap.cells(1))  # the same cells, of its stream
    assert same_kv(llama_state(engine.ctx, 1), llama_state(engine.ctx, 0)), "the K/V bytes were copied at once"
    a_before = list(engine.tokens[0])
    engine.context_shift(1, 2, 6)
    assert engine.tokens[0] == a_before, "shifting the fork must not move the source's cells"
    res = runner.generate(0, a_before, max_new_tokens=3, ignore_eos=True)
    assert res.done.n_cached == len(a_before) - 1
    want = prefill_row(engine, 3, a_before)
    assert_attention_close(res.attention[0], want)


def test_concurrent_sequences_match_running_alone(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    prompts = [
        model.tokenize(CHAT.format(q), False, True) for q in ("Hi!", "Count to five.", "What is 2+2?", "Name a fruit.")
    ]
    alone = []
    for s, p in enumerate(prompts):
        engine.erase(s)
        alone.append(runner.generate(s, p, max_new_tokens=8, ignore_eos=True))
        engine.erase(s)
    reqs = [runner.submit(s, p, max_new_tokens=8, ignore_eos=True) for s, p in enumerate(prompts)]
    runner.run()
    for s, req in enumerate(reqs):
        got = runner.results[req]
        assert got.tokens == alone[s].tokens, s
        for k, (x, y) in enumerate(zip(got.attention, alone[s].attention, strict=True)):
            assert_attention_close(x, y, f"seq {s} token {k}")


def test_preview_fork_leaves_the_sequence_untouched(runner: Runner, engine, model, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine.erase(0)
    runner.generate(0, prompt, max_new_tokens=4, ignore_eos=True)
    runner.batcher.flush()
    tokens, cells, state = list(engine.tokens[0]), engine.cellmap.cells(0).copy(), llama_state(engine.ctx, 0)
    append = model.tokenize("<|im_start|>user\nAnd bats?<|im_end|>\n", False, True)
    res = runner.generate(0, [], mode="preview", append=append, max_new_tokens=6, ignore_eos=True)
    assert res.done.n_prefilled == len(append) and res.done.n_cached == len(tokens)
    assert res.attention[0].shape[-1] == len(tokens) + len(append)
    assert engine.tokens[0] == tokens
    np.testing.assert_array_equal(engine.cellmap.cells(0), cells)
    assert llama_state(engine.ctx, 0) == state  # llama.cpp's own read of the cache, not a cached copy
    assert len(engine.spare_free) == engine.config.n_spare


def test_preview_with_nothing_to_append_decodes_the_last_token_again(runner: Runner, engine, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine.erase(0)
    runner.generate(0, prompt, max_new_tokens=4, ignore_eos=True)
    runner.batcher.flush()
    tokens, state = list(engine.tokens[0]), llama_state(engine.ctx, 0)
    req = runner.submit(0, [], mode="preview", append=[], max_new_tokens=5, ignore_eos=True)
    for _ in range(50):  # bounded: a job that is never scheduled must fail here, not hang
        if not runner.batcher.has_work():
            break
        runner.batcher.step()
    res = runner.results[req]
    assert res.done is not None and res.done.n_generated == 5, res
    assert res.done.n_prefilled == 1 and res.done.n_cached == len(tokens) - 1
    assert not runner.batcher.has_work()  # the worker would block now
    assert engine.tokens[0] == tokens and llama_state(engine.ctx, 0) == state  # read from the cache itself
    assert len(engine.spare_free) == engine.config.n_spare
    # the same tokens and attention as a generation from the slot's tokens on another sequence
    engine.erase(1)
    ref = runner.generate(1, tokens, max_new_tokens=5, ignore_eos=True)
    assert res.tokens == ref.tokens
    assert_attention_close(res.attention[0], ref.attention[0], "first preview token")
