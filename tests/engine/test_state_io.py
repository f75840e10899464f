"""Fast state reads, restores on known cells, and forks/previews/parking after concurrent decoding.

The engine fixture runs with ``verify_cells``: every captured row also checks the cell
mirror against llama.cpp's mask, and every fast state read is compared with
``llama_state_seq_get_data``.  These tests check the same things explicitly, with llama.cpp's
own reads (``engine.kv_io.llama_state``) as the reference.
"""

from __future__ import annotations

import numpy as np

from engine import seq_state
from engine.buffers import BufferPool
from engine.engine import BatchEntry
from engine.kv_io import KvReader, llama_state
from tests.conftest import CHAT
from tests.engine.enginekit import Runner, assert_attention_close

QUESTIONS = ("Tell me about owls.", "Count to ten.", "Name four rivers.", "Why is the sky blue?")


def prompts(model) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [model.tokenize(CHAT.format(q), False, True) for q in QUESTIONS]


def decode_together(runner: Runner, model, n: int = 12) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Four slots generate ``n`` tokens in the same batches; returns what each generated."""
    reqs = [runner.submit(s, p, max_new_tokens=n, ignore_eos=True) for s, p in enumerate(prompts(model))]
    runner.run()
    runner.batcher.flush()
    return [runner.results[r].tokens for r in reqs]


def runs(cells: np.ndarray) -> int:
    """Runs of consecutive cells (what llama.cpp's own state read copies one by one)."""
    c = np.sort(cells)
    return int(1 + np.count_nonzero(np.diff(c) != 1)) if len(c) else 0


def same_kv(a: bytearray, b: bytearray) -> bool:
    """Two states hold the same positions and K/V bytes (their sequence ids aside)."""
    pa, pb = seq_state.parse(a), seq_state.parse(b)
    if not np.array_equal(pa.positions, pb.positions):
        return False
    return all(a[o : o + n] == b[p : p + m] for (_, o, n), (_, p, m) in zip(pa.data, pb.data, strict=True))


def test_fast_read_equals_llama_cpp_after_concurrent_decoding(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    decode_together(runner, model)
    reader = engine.reader.fast
    assert isinstance(reader, KvReader), "the self-check enabled the fast reader"
    for s in range(4):
        cells = engine.cellmap.cells(s)
        assert runs(cells) > 10, "the cells of concurrent sequences interleave"
        assert reader.read(s, cells) == llama_state(engine.ctx, s), s
    # shared cells (a fork), a truncated tail and a context shift
    engine.fork(1, 5)
    assert reader.read(5, engine.cellmap.cells(5)) == llama_state(engine.ctx, 5)
    engine.truncate(2, 17)
    assert reader.read(2, engine.cellmap.cells(2)) == llama_state(engine.ctx, 2)
    engine.context_shift(3, 4, 6)
    assert reader.read(3, engine.cellmap.cells(3)) == llama_state(engine.ctx, 3)
    engine.erase(5)
    assert reader.read(5, engine.cellmap.cells(5)) == llama_state(engine.ctx, 5), "an empty sequence"


def test_restore_lands_on_the_first_free_cells(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    decode_together(runner, model)
    tokens, blob = engine.save_state(2)
    blob = bytes(blob)  # read-only: restored in place all the same
    engine.erase(1)  # one-cell holes between the other slots' cells
    free = np.flatnonzero(~engine.cellmap.occupied())
    engine.restore_state(1, tokens, blob)
    cells = engine.cellmap.cells(1)
    positions = seq_state.parse(blob, engine.layout).positions
    np.testing.assert_array_equal(np.sort(cells), free[: len(tokens)])
    np.testing.assert_array_equal(cells[positions], free[: len(tokens)])  # blob order -> ascending free cells
    # the mirror agrees with llama.cpp: the same state, and a captured row's mask shows the same cells
    assert same_kv(llama_state(engine.ctx, 1), llama_state(engine.ctx, 2))
    target = engine.new_target(1, len(tokens), None)
    target.want_mask = True
    assert engine.decode([BatchEntry(1, len(tokens), [tokens[-1]], logits=True, target=target)]) == 0
    assert target.mask is not None
    visible = np.flatnonzero(np.isfinite(target.mask))
    np.testing.assert_array_equal(visible, np.sort(engine.cellmap.cells(1)))


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
    blob = bytearray(blob)  # parked: the slot's cells leave the cache
    engine.erase(1)
    # the others go on, filling the holes the parked slot left
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


def test_a_changed_sequence_is_read_into_the_memory_of_its_old_state(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    """A state copy dropped when its sequence changes is reused by the next read, written whole:
    the read equals llama.cpp's, whatever the old bytes were."""
    decode_together(runner, model, n=4)
    engine.state_pool = BufferPool(keep=1)  # empty (the engine fixture is shared)
    _, first = engine.save_state(0)
    size = len(first)
    del first
    assert engine.state_pool.held_bytes == 0
    runner.submit(0, [int(t) for t in model.tokenize(" More.", False, False)], max_new_tokens=2, ignore_eos=True)
    runner.run()  # seq 0 now holds the short prompt + 2 tokens: its old copy went back to the pool
    assert engine.state_pool.held_bytes == size
    _, second = engine.save_state(0)
    assert len(second) < size
    assert engine.state_pool.held_bytes == 0, "the next read took the kept memory"
    assert second == llama_state(engine.ctx, 0)
    _, blob = engine.save_state(1)
    engine.offload(1)
    engine.make_resident(1)  # the offloaded copy is not recycled by the restore's erase
    assert engine.state_pool.held_bytes == 0
    assert engine.save_state(1)[1] is blob and blob == llama_state(engine.ctx, 1)


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
