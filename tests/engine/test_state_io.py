"""States in the one-stream form, restores, and forks/previews/parking after concurrent decoding.

The engine fixture runs with ``verify_cells``: every captured row also checks the cell mirror
against llama.cpp's KV cache.  These tests check the states explicitly, with llama.cpp's own
reads (``tests.engine.enginekit.llama_state``) as the reference.
"""

from __future__ import annotations

import weakref

import numpy as np

from contract.buffers import BufferPool
from contract.settings import EngineSettings
from engine.engine import Engine
from slotstate import seq_state
from tests.conftest import CHAT
from tests.engine.enginekit import Runner, assert_attention_close, llama_state, same_kv

QUESTIONS = ("Tell me about owls.", "Count to ten.", "Name four rivers.", "Why is the sky blue?")


def prompts(model) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [model.tokenize(CHAT.format(q), False, True) for q in QUESTIONS]


def decode_together(runner: Runner, model, n: int = 12) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Four slots generate ``n`` tokens in the same batches; returns what each generated."""
    reqs = [runner.submit(s, p, max_new_tokens=n, ignore_eos=True) for s, p in enumerate(prompts(model))]
    runner.run()
    runner.batcher.flush()
    return [runner.results[r].tokens for r in reqs]


def test_saved_states_are_one_stream_and_llama_cpps(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    decode_together(runner, model)
    for s in range(4):
        tokens, state = engine.save_state(s)
        parsed = seq_state.parse(state, engine.layout)
        assert parsed.n_stream == 1 and len(parsed.positions) == len(tokens), "the one-stream form"
        assert bytes(state) == llama_state(engine.ctx, s), s
    # a fork, a truncated tail, a context shift (cells out of position order) and an empty sequence
    engine.fork(1, 5)
    assert bytes(engine.save_state(5)[1]) == llama_state(engine.ctx, 5)
    assert same_kv(llama_state(engine.ctx, 5), llama_state(engine.ctx, 1))
    engine.truncate(2, 17)
    assert bytes(engine.save_state(2)[1]) == llama_state(engine.ctx, 2)
    engine.context_shift(3, 4, 6)
    assert bytes(engine.save_state(3)[1]) == llama_state(engine.ctx, 3)
    engine.erase(5)
    assert len(seq_state.parse(engine.save_state(5)[1]).positions) == 0, "an empty sequence"


def test_restore_after_a_context_shift_learns_its_cells(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    """A context shift leaves a hole in the stream that the next tokens fill: cells out of position
    order.  A state of such a sequence restores (elsewhere) with the cells llama.cpp chose, which the
    mirror takes from the cache; the restored copy attends as the original does."""
    decode_together(runner, model)
    engine.context_shift(2, 3, 5)
    grown = runner.generate(2, [*engine.tokens[2], 13, 14, 15], max_new_tokens=2, ignore_eos=True)
    assert grown.done is not None
    runner.batcher.flush()
    cells = engine.cellmap.cells(2)
    assert not np.all(np.diff(cells) > 0), "the new tokens filled the hole"
    tokens, blob = engine.save_state(2)
    engine.restore_state(1, tokens, bytes(blob))  # read-only: restored in place all the same
    assert same_kv(llama_state(engine.ctx, 1), llama_state(engine.ctx, 2))
    a = runner.generate(1, [*tokens, 16], max_new_tokens=3, ignore_eos=True)
    b = runner.generate(2, [*tokens, 16], max_new_tokens=3, ignore_eos=True)
    assert a.tokens == b.tokens
    for k, (x, y) in enumerate(zip(a.attention, b.attention, strict=True)):
        np.testing.assert_allclose(x, y, atol=1e-6, err_msg=f"token {k}")


def test_a_state_restores_into_an_engine_with_another_stream_count(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    """States do not depend on how many sequences (KV streams) their engine has."""
    decode_together(runner, model, n=4)
    tokens, blob = engine.save_state(0)
    blob = bytes(blob)
    same = engine.config.flash_attn  # a state restores only under the same flash attention setting (V layout)
    other = Engine(
        model, EngineSettings(n_ctx=512, n_slots=1, n_spare=0, n_threads=2, verify_cells=True, flash_attn=same)
    )
    try:
        other.restore_state(0, tokens, blob, check_values=True)
        assert bytes(other.save_state(0)[1]) == blob[:4] + (0).to_bytes(4, "little") + blob[8:], "seq 0's state"
        mine = Runner(other).generate(0, [*tokens, 42], max_new_tokens=3, ignore_eos=True)
    finally:
        other.close()
    theirs = runner.generate(0, [*tokens, 42], max_new_tokens=3, ignore_eos=True)
    assert mine.tokens == theirs.tokens
    for k, (x, y) in enumerate(zip(mine.attention, theirs.attention, strict=True)):
        assert_attention_close(x, y, f"token {k}")


def test_preview_and_fork_leave_the_slot_unchanged(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    decode_together(runner, model)
    tokens, cells, kv = list(engine.tokens[0]), engine.cellmap.cells(0).copy(), llama_state(engine.ctx, 0)
    append = model.tokenize("<|im_start|>user\nAnd bats?<|im_end|>\n", False, True)
    res = runner.generate(0, [], mode="preview", append=append, max_new_tokens=6, ignore_eos=True)
    assert res.done is not None and res.done.n_cached == len(tokens)
    engine.fork(0, 3)
    forked = runner.generate(3, tokens + append, max_new_tokens=6, ignore_eos=True)
    engine.erase(3)
    assert forked.done is not None and forked.done.n_cached == len(tokens)
    assert engine.tokens[0] == tokens
    np.testing.assert_array_equal(engine.cellmap.cells(0), cells)
    assert llama_state(engine.ctx, 0) == kv, "the slot's KV bytes are unchanged"
    assert len(engine.spare_free) == engine.config.n_spare
    # attention of the preview and of the forked copy == the original's, token for token while
    # their greedy tokens agree (the first always does: the same prefix and the same append)
    b = runner.generate(0, tokens + append, max_new_tokens=6, ignore_eos=True)
    for name, other in (("preview", res), ("fork", forked)):
        same = next((k for k, (x, y) in enumerate(zip(other.tokens, b.tokens, strict=True)) if x != y), 6)
        assert same >= 1, name
        for k in range(same):
            assert_attention_close(other.attention[k], b.attention[k], f"{name} token {k}")


def test_parking_after_concurrent_decoding_continues_as_running_alone(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    first = decode_together(runner, model, n=10)
    tokens, blob = engine.save_state(1)
    blob = bytes(blob)  # parked: the slot's cells leave the cache
    engine.erase(1)
    # the others go on
    others = [runner.submit(s, list(engine.tokens[s]), max_new_tokens=6, ignore_eos=True) for s in (0, 2, 3)]
    runner.run()
    runner.batcher.flush()
    assert all(runner.results[r].done is not None for r in others)
    engine.restore_state(1, tokens, blob)
    assert llama_state(engine.ctx, 1) == blob, "restored byte for byte"
    resumed = runner.generate(1, tokens, max_new_tokens=8, ignore_eos=True)
    assert resumed.done is not None and resumed.done.n_cached == len(tokens) - 1
    # alone: the same prompt generated in one go on an empty cache
    for s in range(4):
        engine.erase(s)
    alone = runner.generate(1, prompts(model)[1], max_new_tokens=18, ignore_eos=True)
    assert first[1] + resumed.tokens[:8] == alone.tokens
    # attention of the restored slot == the same queries computed alone
    for k, (x, y) in enumerate(zip(resumed.attention, alone.attention[10:], strict=True)):
        assert_attention_close(x, y, f"restored token {k}")


def test_the_engine_keeps_no_copy_of_a_state_and_a_handed_back_one_serves_the_next_read(  # type: ignore[no-untyped-def]
    runner: Runner, engine, model
) -> None:
    """A state read is the caller's alone: dropped without being handed back, its memory is freed (the
    engine kept no copy of it); handed back, the next read is written into it, whole: the read equals
    llama.cpp's, whatever the old bytes were; and kept memory is freed once idle."""
    decode_together(runner, model, n=4)
    now = [0.0]
    engine.state_pool = BufferPool(keep=1, clock=lambda: now[0])  # empty (the engine fixture is shared)
    _, first = engine.save_state(0)
    gone = weakref.ref(first.obj)
    size = len(first)
    del first
    assert gone() is None, "the engine kept the state's memory"
    _, again = engine.save_state(1)
    assert engine.save_state(1)[1] is not again, "every save reads the sequence now"
    n_again = len(again)
    engine.release_state(again)
    assert engine.state_pool.held_bytes >= n_again
    engine.truncate(1, engine.seq_len(1) - 1)  # seq 1 changes: a state one cell smaller
    _, second = engine.save_state(1)
    assert len(second) < n_again and size > 0
    assert engine.state_pool.held_bytes == 0, "the next read took the kept memory"
    assert bytes(second) == llama_state(engine.ctx, 1)
    engine.release_state(second)
    now[0] += engine.state_pool.idle_s or 0.0
    assert engine.state_pool.release_idle() > 0 and engine.state_pool.held_bytes == 0, "idle memory is freed"


def test_an_empty_sequence_state_restores(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp writes an empty sequence as its stream's cell count (0) alone; it parses to no
    positions and restores to an empty sequence (a slot emptied by a context shift comes back)."""
    decode_together(runner, model, n=2)
    engine.erase(5)
    blob = llama_state(engine.ctx, 5)
    assert len(seq_state.parse(blob, engine.layout).positions) == 0
    engine.restore_state(2, [], blob)
    assert engine.seq_len(2) == 0 and engine.cellmap.length(2) == 0
    engine.restore_state(2, *engine.save_state(2))  # our own empty state too
    assert engine.seq_len(2) == 0


def test_an_empty_state_restores_with_its_values_checked(engine) -> None:  # type: ignore[no-untyped-def]
    """A sequence emptied (a context shift of everything, then parked) restores from its empty state, values
    checked as every restore from the store is (there are none to test)."""
    engine.erase(5)
    tokens, state = engine.save_state(5)
    assert tokens == []
    engine.restore_state(5, tokens, bytes(state), check_values=True)
    assert engine.seq_len(5) == 0
