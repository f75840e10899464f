"""Idle slots leave the KV cache when a job starts (``cache_idle_slots``) and come back intact.

They leave when that reads nothing (their state was read since they last changed) or when the
cache lacks room; otherwise they stay, because reading a state stalls every stream.
"""

from __future__ import annotations

import llama_cpp as llama
import msgspec
import numpy as np
import pytest

from engine.batcher import CHEAP_RUNS
from engine.engine import BatchEntry, EngineError
from tests.conftest import CHAT
from tests.engine.enginekit import Runner, assert_attention_close


def n_cells(engine, seq: int) -> int:  # type: ignore[no-untyped-def]
    return int(llama.llama_memory_seq_pos_max(engine.mem, seq) + 1)


def test_a_new_job_offloads_idle_slots_and_they_come_back(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    a = model.tokenize(CHAT.format("Name three birds."), False, True)
    b = model.tokenize(CHAT.format("Count to four."), False, True)
    first = runner.generate(0, a, max_new_tokens=6, ignore_eos=True)
    runner.batcher.flush()
    tokens0, blob0 = engine.save_state(0)
    follow = tokens0 + model.tokenize("\nMore:", False, False)
    # what slot 0 says next while it stays in the cache (a fork: same cells)
    engine.fork(0, 3)
    control = runner.generate(3, follow, max_new_tokens=6, ignore_eos=True)
    engine.erase(3)

    runner.generate(1, b, max_new_tokens=4, ignore_eos=True)  # a job on slot 1 moves slot 0 out
    assert 0 in engine.offloaded and n_cells(engine, 0) == 0 and engine.cellmap.length(0) == 0
    assert engine.tokens[0] == tokens0, "the token list stays"
    assert engine.save_state(0) == (tokens0, blob0), "save-state of an offloaded slot is its state"
    with pytest.raises(EngineError) as err:
        engine.decode([BatchEntry(0, len(tokens0), [1])])
    assert err.value.code == "INTERNAL"

    runner.batcher.flush()
    engine.save_state(1)  # (the write-behind save after slot 1's generation)
    again = runner.generate(0, follow, max_new_tokens=6, ignore_eos=True)  # brings it back, moves slot 1 out
    assert 0 not in engine.offloaded and 1 in engine.offloaded
    assert again.done is not None and again.done.n_cached == len(tokens0), "no re-prefill"
    assert again.tokens == control.tokens
    for k, (x, y) in enumerate(zip(again.attention, control.attention, strict=True)):
        assert_attention_close(x, y, f"token {k}")
    assert len(first.tokens) == 6


def test_operations_bring_an_offloaded_slot_back(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    a = model.tokenize(CHAT.format("Tell me about rivers."), False, True)
    runner.generate(0, a, max_new_tokens=8, ignore_eos=True)
    runner.batcher.flush()
    tokens0, _ = engine.save_state(0)
    assert engine.offload(0) > 0 and engine.offload(0) == 0  # once
    engine.fork(0, 2)  # the source comes back for seq_cp
    assert 0 not in engine.offloaded and engine.tokens[2] == tokens0
    assert n_cells(engine, 2) == len(tokens0)
    engine.offload(0)
    engine.truncate(0, len(tokens0) - 3)
    assert 0 not in engine.offloaded and n_cells(engine, 0) == len(tokens0) - 3
    engine.offload(0)
    assert engine.context_shift(0, 4, 5) == len(tokens0) - 8 and 0 not in engine.offloaded
    engine.offload(0)
    engine.erase(0)
    assert 0 not in engine.offloaded and 0 not in engine.tokens


def test_off_switch_and_busy_slots_stay(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    a = model.tokenize(CHAT.format("Hello!"), False, True)
    runner.generate(0, a, max_new_tokens=3, ignore_eos=True)
    # a preview of slot 0 and a generation on slot 1 at once: slot 0 is the preview's parent, so it stays
    p = runner.submit(0, [], mode="preview", append=model.tokenize("\nAnd?", False, False), max_new_tokens=3)
    g = runner.submit(1, a, max_new_tokens=3, ignore_eos=True)
    runner.run()
    assert runner.results[p].done is not None and runner.results[g].done is not None
    assert 0 not in engine.offloaded
    cfg = engine.config
    engine.config = msgspec.structs.replace(cfg, cache_idle_slots=False)
    try:
        runner.generate(2, a, max_new_tokens=2, ignore_eos=True)
        assert not engine.offloaded & {0, 1}
    finally:
        engine.config = cfg
    assert np.all(engine.cellmap.cells(0) >= 0)


def test_a_saved_state_is_kept_until_the_sequence_changes(runner: Runner, engine, model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    reads: list[int] = []
    real = llama.llama_state_seq_get_data
    monkeypatch.setattr(llama, "llama_state_seq_get_data", lambda *a: reads.append(a[3]) or real(*a))
    a = model.tokenize(CHAT.format("Say something about tea."), False, True)
    runner.generate(0, a, max_new_tokens=4, ignore_eos=True)
    runner.batcher.flush()
    toks, blob = engine.save_state(0)
    assert engine.save_state(0)[1] is blob and reads == [0], "saved once"
    assert engine.offload(0) == len(blob) and reads == [0], "offloading a saved sequence reads nothing"
    engine.make_resident(0)  # (learning the cells reads the scratch sequence's state)
    assert engine.save_state(0)[1] is blob and reads.count(0) == 1
    # any change drops the copy: a stale state must never be offloaded or saved
    extra = model.tokenize(" More.", False, False)
    more = runner.generate(0, toks + extra, max_new_tokens=3, ignore_eos=True)
    runner.batcher.flush()
    toks2, blob2 = engine.save_state(0)
    assert reads.count(0) == 2 and blob2 is not blob and toks2 == toks + extra + more.tokens
    assert seq_state_positions(engine, blob2) == len(toks2)
    engine.truncate(0, 5)
    assert seq_state_positions(engine, engine.save_state(0)[1]) == 5
    engine.context_shift(0, 1, 2)
    assert seq_state_positions(engine, engine.save_state(0)[1]) == 3


def seq_state_positions(engine, blob: bytearray) -> int:  # type: ignore[no-untyped-def]
    from engine import seq_state

    return len(seq_state.parse(blob, engine.layout).positions)


def test_unread_idle_slots_stay_unless_the_cache_lacks_room(runner: Runner, engine, model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    a = model.tokenize(CHAT.format("Name a tree."), False, True)
    runner.generate(0, a, max_new_tokens=4, ignore_eos=True)
    runner.generate(1, a, max_new_tokens=4, ignore_eos=True)
    runner.batcher.flush()
    assert not engine.offloaded and 0 not in engine.states, "slot 0's state was never read: it stays"
    kv0 = engine.save_state(0)[1]
    del engine.states[0]  # (as if unread)
    # a cache with fewer free cells than the next job needs: idle slots go (their states read) until
    # there is room; one slot's cells are enough here, so slot 1 stays
    monkeypatch.setattr(engine, "free_cells", lambda: 8)
    runner.generate(2, a, max_new_tokens=4, ignore_eos=True)
    assert engine.offloaded == {0} and bytes(engine.states[0]) == bytes(kv0)
    monkeypatch.undo()
    back = runner.generate(0, a, max_new_tokens=4, ignore_eos=True)
    assert 0 not in engine.offloaded and back.done is not None and back.done.n_cached == len(a) - 1


def test_idle_slots_whose_cells_interleave_stay(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    """Slots that decoded together hold one-cell runs: moving them out is cheap, bringing them back
    is not (a restore copies run by run), so they stay even with their states read."""
    prompts = [model.tokenize(CHAT.format(q), False, True) for q in ("Hi.", "Yes?", "No.", "Go.")]
    reqs = [runner.submit(s, p, max_new_tokens=24, ignore_eos=True) for s, p in enumerate(prompts)]
    runner.run()
    runner.batcher.flush()
    for s in range(4):
        engine.save_state(s)
        assert engine.cell_runs(s) > CHEAP_RUNS
    again = runner.generate(0, list(engine.tokens[0]), max_new_tokens=2, ignore_eos=True)
    assert again.done is not None and not engine.offloaded
    assert all(runner.results[r].done is not None for r in reqs)
