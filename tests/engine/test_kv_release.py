"""An empty sequence's KV stream given back to the kernel (``Engine.release``, libllama's
``llama_attn_kv_seqs_release``).

llama.cpp allocates every stream of every layer's K and V when the context is made and clears them, so
all of them are resident from the start; the release gives an empty stream's pages back
(``madvise(MADV_DONTNEED)``: they read back as zeros, what the clear wrote).  Checked on the real model,
with flash attention off (V transposed) and on, and on a Gemma-3-shaped sliding-window model (two KV
caches): the bytes given back and the process's resident anonymous memory dropping by them, a sequence
holding cells left exactly as it was, generations over released streams equal token for token and row
for row to generations over streams that still hold stale K/V, a stream copy pending from a sequence
applied before its stream is released, a context shift (whose K-shift writes the K of every stream)
followed by a release of the streams it wrote, a restore into a released stream equal byte for byte and
in its continuation, taking back only what it writes, and an erased stream kept resident for
``engine.kv_release.RELEASE_DELAY_S`` (a restore then writes into its resident pages) and given back after.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as llama
import numpy as np
import pytest

from contract.settings import EngineSettings
from engine import native
from engine.engine import Engine, read_state
from engine.kv_release import ReleaseSchedule
from engine.model import Model
from engine.state_file import load_seq_file, write_slot_file
from slotstate import seq_state
from tests.engine.enginekit import Result, Runner, llama_state, same_kv
from tests.tiny_models import build_tiny_gguf


def rss_anon() -> int:
    """Resident anonymous memory of this process in bytes (``RssAnon`` of ``/proc/self/status``, proc(5))."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def stream_bytes(engine: Engine, seq: int, prompt: list[int]) -> int:
    """K/V bytes of one sequence's stream in every KV cache (``n_cells`` cells each), measured from two of
    llama.cpp's sequence states: the growth per token less its 12 bytes of cell metadata
    (``llama_kv_cache::state_write_meta``: position, seq-id count, seq id) per KV cache."""
    sizes = []
    for n in (2, 3):
        engine.erase(seq)
        Runner(engine).generate(seq, prompt[:n], max_new_tokens=1)  # n tokens in the KV cache after the flush
        sizes.append(len(llama_state(engine.ctx, seq)))
    engine.erase(seq)
    return (sizes[1] - sizes[0] - 12 * engine.shape.n_caches) * engine.n_cells


def generate_pair(
    engine: Engine, seqs: tuple[int, int], prompts: tuple[list[int], list[int]], release: bool
) -> list[Result]:
    """Greedy generations on two sequences at once (one batch per step), each from an empty sequence
    (``release``: its stream given back first, else holding what it held)."""
    for s in seqs:
        engine.erase(s, release=release)
    run = Runner(engine)
    reqs = [run.submit(s, p, max_new_tokens=12, ignore_eos=True) for s, p in zip(seqs, prompts, strict=True)]
    run.run()
    return [run.results[r] for r in reqs]


def assert_same(a: list[Result], b: list[Result]) -> None:
    """The same tokens and bit-identical attention rows."""
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None
        assert x.tokens == y.tokens
        assert len(x.attention) == len(y.attention)
        assert all(np.array_equal(r, s) for r, s in zip(x.attention, y.attention, strict=True))


@pytest.fixture
def prompt(model) -> list[int]:  # type: ignore[no-untyped-def]
    text = "<|im_start|>user\nWrite a long story about a lighthouse keeper and a storm.<|im_end|>\n"
    return list(model.tokenize(text * 6, True, True))


def test_an_empty_stream_is_given_back(runner: Runner, prompt: list[int]) -> None:
    """A fork copies the whole stream (every page resident); its release gives back about one stream of K/V,
    and the resident memory drops by at least half of it."""
    eng = runner.engine
    size = stream_bytes(eng, 0, prompt)
    runner.generate(0, prompt, max_new_tokens=2)
    spare = eng.take_spare()
    try:
        eng.fork(0, spare)  # llama.cpp copies the stream: all of spare's pages written
        eng.erase(spare, release=False)
        before = rss_anon()
        got = eng.release(spare)
        dropped = before - rss_anon()
        assert 0.97 * size <= got <= size, (got, size)  # the page-aligned interior of each layer's range
        assert dropped >= size // 2, (dropped, size)
        assert eng.release(spare) == got  # again: the same range, nothing left to drop
    finally:
        eng.give_spare(spare)


def test_several_empty_streams_are_given_back_in_one_call(runner: Runner, prompt: list[int], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``release_empty`` gives every empty stream back with one call of ``llama_attn_kv_seqs_release`` (one backend
    synchronization, not one per stream), the resident memory dropping by the two written streams; a sequence
    holding cells is skipped and left as it was; the bytes are those of releasing the streams one by one, and a
    sequence listed twice counts once."""
    eng = runner.engine
    size = stream_bytes(eng, 1, prompt)
    runner.generate(0, prompt, max_new_tokens=2)
    state = llama_state(eng.ctx, 0)
    for s in (1, 2):
        eng.fork(0, s)  # llama.cpp copies the stream: all of its pages written
        eng.erase(s, release=False)
    calls: list[list[int]] = []
    c_release = native.lib.llama_attn_kv_seqs_release

    def counted(ctx, ids, n):  # type: ignore[no-untyped-def]
        calls.append(list(ids[:n]))
        return c_release(ctx, ids, n)

    before = rss_anon()
    with monkeypatch.context() as m:
        m.setattr(native.lib, "llama_attn_kv_seqs_release", counted)
        got = eng.release_empty()
    dropped = before - rss_anon()
    assert calls == [[s for s in range(eng.n_stream) if s != 0]]
    assert dropped >= size, (dropped, size)  # at least half of each of streams 1 and 2
    assert llama_state(eng.ctx, 0) == state
    one_by_one = [eng.release(s) for s in range(eng.n_stream)]
    assert one_by_one[0] == 0 and all(n > 0 for n in one_by_one[1:]), one_by_one
    assert got == sum(one_by_one)
    assert eng.release(1, 2) == one_by_one[1] + one_by_one[2]
    assert eng.release(0, 2, 2) == one_by_one[2]
    assert eng.release() == 0
    assert llama_state(eng.ctx, 0) == state


def test_a_bad_sequence_list_gives_nothing_back(runner: Runner, prompt: list[int]) -> None:
    """``llama_attn_kv_seqs_release`` with a sequence id outside ``[0, n_seq_max)``, a negative count, no array or
    no context returns -1 and gives no stream of the list back; an empty list gives back nothing (0)."""
    eng = runner.engine
    size = stream_bytes(eng, 1, prompt)
    runner.generate(0, prompt, max_new_tokens=2)
    eng.fork(0, 1)  # every page of stream 1 written
    eng.erase(1, release=False)
    n_seq_max = llama.llama_n_seq_max(eng.ctx)
    release = native.lib.llama_attn_kv_seqs_release

    def ids(*seqs: int) -> ctypes.Array[ctypes.c_int32]:
        return (ctypes.c_int32 * len(seqs))(*seqs)

    before = rss_anon()
    assert release(eng.ctx, ids(1, n_seq_max), 2) == -1
    assert release(eng.ctx, ids(1, -1), 2) == -1
    assert release(eng.ctx, ids(1), -1) == -1
    assert release(eng.ctx, None, 1) == -1
    assert release(None, ids(1), 1) == -1
    assert release(eng.ctx, None, 0) == 0
    assert before - rss_anon() < size // 4, (before - rss_anon(), size)  # stream 1 still resident
    assert release(eng.ctx, ids(1), 1) > 0
    assert before - rss_anon() >= size // 2, (before - rss_anon(), size)


def test_a_sequence_with_cells_is_left_as_it_was(runner: Runner, prompt: list[int]) -> None:
    eng = runner.engine
    first = runner.generate(0, prompt, max_new_tokens=4, ignore_eos=True)
    state = llama_state(eng.ctx, 0)
    assert eng.release(0) == 0
    assert llama_state(eng.ctx, 0) == state
    # the generation goes on from the slot's cells as it would have
    more = runner.generate(0, [*prompt, *first.tokens], max_new_tokens=6, ignore_eos=True)
    eng.erase(0)
    again = runner.generate(0, [*prompt, *first.tokens], max_new_tokens=6, ignore_eos=True)
    assert more.done is not None and more.done.n_cached > 0
    assert more.tokens == again.tokens


def test_generations_over_released_streams_equal_those_over_stale_ones(runner: Runner, prompt: list[int]) -> None:
    """Streams 0 and 2 decode together (their K/V views span stream 1); first with every other stream
    holding a former conversation's K/V (erased, not released), then with all of them released."""
    eng = runner.engine
    other = prompt[5:] + prompt[:5]
    for s in range(eng.config.n_slots):
        runner.generate(s, other, max_new_tokens=2)
        eng.erase(s, release=False)
    stale = generate_pair(eng, (0, 2), (prompt, prompt[:40]), release=False)
    for s in (0, 2):
        eng.erase(s, release=False)
    assert eng.release_empty() > 0
    released = generate_pair(eng, (0, 2), (prompt, prompt[:40]), release=True)
    assert_same(stale, released)


def test_a_pending_stream_copy_is_made_before_its_source_is_released(runner: Runner, prompt: list[int]) -> None:
    """``llama_memory_seq_cp`` across streams copies at the next update; a release of the source after it
    lost its cells applies that copy first, so the copy holds the source's K/V, not zeros."""
    eng = runner.engine
    runner.generate(0, prompt, max_new_tokens=2)
    want = llama_state(eng.ctx, 0)
    spare = eng.take_spare()
    try:
        llama.llama_memory_seq_cp(eng.mem, 0, spare, -1, -1)  # pending: no update called
        llama.llama_memory_seq_rm(eng.mem, 0, -1, -1)
        assert eng.release(0) > 0
        native.lib.llama_attn_memory_update(eng.ctx)
        assert same_kv(llama_state(eng.ctx, spare), want)
    finally:
        eng.erase(spare, release=False)
        eng.give_spare(spare)
        eng.erase(0)


def test_a_context_shift_gives_back_what_its_k_shift_wrote(runner: Runner, prompt: list[int], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The K-shift writes the K of every stream, empty ones too; the shift releases them again, and the
    shifted sequence generates exactly as it does without any release."""
    eng = runner.engine

    def shifted() -> Result:
        eng.erase(0, release=False)
        runner.generate(0, prompt, max_new_tokens=2)
        eng.context_shift(0, 4, 40)
        return runner.generate(0, list(eng.tokens[0]), max_new_tokens=10, ignore_eos=True)

    with monkeypatch.context() as m:
        m.setattr(eng, "release", lambda *seqs: 0)
        kept = shifted()
    eng.release_empty()
    eng.erase(0, release=False)
    runner.generate(0, prompt, max_new_tokens=2)
    before = rss_anon()
    eng.context_shift(0, 4, 40)
    grew = rss_anon() - before
    assert grew < stream_bytes(eng, 1, prompt) // 4, grew  # unreleased: half of each empty stream (its K)
    assert shifted().tokens == kept.tokens


def test_a_restore_into_a_released_stream(runner: Runner, prompt: list[int], tmp_path: Path) -> None:
    """A slot file (one pass from the file) and a state in memory restored into streams given back first hold
    the saved K/V byte for byte and continue token for token as the saved sequence does; the restore takes
    back the pages it writes, not the stream: with V by rows (flash attention) about the state's K/V, with V
    transposed at most its K and the stream's V range (each embedding row of V is written)."""
    eng = runner.engine
    size = stream_bytes(eng, 0, prompt)
    short = prompt[:100]  # about 5 % of a stream's cells
    first = runner.generate(0, short, max_new_tokens=3, ignore_eos=True)
    tokens, state = eng.save_state(0)
    want = bytes(state)
    write_slot_file(tmp_path / "slot.bin", tokens, state)
    eng.release_state(state)
    kv_bytes = sum(n for _, _, n in seq_state.parse(want).data)
    for s in (1, 2):
        eng.fork(0, s)  # every page of the stream written, then given back
        eng.erase(s)
    assert eng.release(1) > 0 and eng.release(2) > 0
    before = rss_anon()
    assert load_seq_file(eng, 1, tmp_path / "slot.bin")[0] == len(tokens)
    grew = rss_anon() - before
    eng.restore_state(2, tokens, want, check_values=True)
    bound = kv_bytes if eng.config.flash_attn == "on" else kv_bytes // 2 + size // 2
    assert grew <= bound + (1 << 20), (grew, bound)
    for s in (1, 2):
        assert eng.tokens[s] == tokens and same_kv(llama_state(eng.ctx, s), want)
    longer = [*short, *first.tokens]
    cont = [runner.generate(s, longer, max_new_tokens=8, ignore_eos=True) for s in (0, 1, 2)]
    assert all(c.done is not None and c.done.n_cached > 0 for c in cont)
    assert_same(cont[:1], cont[1:2])
    assert_same(cont[:1], cont[2:])


def test_sliding_window_model_releases_both_caches(tmp_path: Path) -> None:
    """Gemma-3-shaped (a global and a sliding-window KV cache): a stream copied whole is given back, a
    sequence with cells keeps them, and a generation over a released stream equals one over a stale one."""
    model = Model(build_tiny_gguf("gemma3", tmp_path))
    cfg = EngineSettings(n_ctx=1024, n_slots=2, n_spare=1, n_threads=2, type_k="f32", type_v="f32",
                         flash_attn="off", verify_cells=True)  # type: ignore[arg-type]  # fmt: skip
    eng = Engine(model, cfg)
    try:
        assert eng.memory.kind == "iswa"
        prompt = [(7 * i) % (model.n_vocab - 10) + 5 for i in range(600)]  # past the 512-token window
        run = Runner(eng)
        run.generate(1, prompt, max_new_tokens=2)
        eng.fork(1, 2)  # the copy writes both caches' streams whole
        eng.erase(2, release=False)
        before = rss_anon()
        got = eng.release(2)
        assert got > 0 and before - rss_anon() >= got // 2, (got, before - rss_anon())
        state = bytes(read_state(eng.ctx, 1, shape=eng.shape)[1])  # both caches' records
        assert eng.release(1) == 0 and bytes(read_state(eng.ctx, 1, shape=eng.shape)[1]) == state
        eng.erase(1, release=False)
        run.generate(0, prompt[::-1], max_new_tokens=2)  # stream 0 holds another conversation's K/V
        eng.erase(0, release=False)
        stale = run.generate(0, prompt, max_new_tokens=8, ignore_eos=True)
        eng.erase(0, release=False)
        assert eng.release_empty() > 0
        released = run.generate(0, prompt, max_new_tokens=8, ignore_eos=True)
        assert_same([stale], [released])
    finally:
        eng.close()
        model.close()


def test_an_erased_stream_stays_resident_for_the_release_delay(runner: Runner, prompt: list[int]) -> None:
    """An erase gives the stream back only the release delay later, and only if it is still empty: a restore
    before that writes into resident pages (the memory does not grow by the state), one after the delay
    takes the pages back (it grows by about the state's K/V); both restore the same K/V."""
    eng = runner.engine
    now = [0.0]
    eng.releases = ReleaseSchedule(delay_s=5.0, clock=lambda: now[0])
    try:
        runner.generate(0, prompt * 4, max_new_tokens=2, ignore_eos=True)
        tokens, state = eng.save_state(0)
        want = bytes(state)
        eng.release_state(state)
        kv_bytes = sum(n for _, _, n in seq_state.parse(want).data)
        eng.erase(0)
        assert eng.release_due() == 0 and eng.releases.next_in() == 5.0, "not at once"
        before = rss_anon()
        eng.restore_state(0, tokens, want, check_values=True)
        assert rss_anon() - before < kv_bytes // 4, (rss_anon() - before, kv_bytes)
        now[0] = 6.0
        assert eng.release_due() == 0, "due, but the sequence holds cells again: kept"
        eng.erase(0)
        now[0] = 10.0
        assert eng.release_due() == 0 and eng.releases.next_in() == 1.0, "a later erase moved the release on"
        now[0] = 11.0
        assert eng.release_due() >= kv_bytes // 2
        before = rss_anon()
        eng.restore_state(0, tokens, want, check_values=True)
        assert rss_anon() - before >= kv_bytes // 2, (rss_anon() - before, kv_bytes)
        assert eng.tokens[0] == tokens and same_kv(llama_state(eng.ctx, 0), want)
    finally:
        eng.releases = ReleaseSchedule()
        eng.erase(0)
