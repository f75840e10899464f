"""Slot files written and read by the engine (``engine.state_file``): the same bytes as llama.cpp's
own files, a load that continues greedily like the original, and refusals that leave every
sequence (and the cells of the cache) as they were."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from contract.errors import ErrorCode
from contract.settings import EngineSettings
from engine.batch import BatchEntry
from engine.capture import seq_cells
from engine.engine import Engine, read_state
from engine.errors import EngineError
from engine.model import Model
from engine.state_file import load_seq_file, write_slot_file
from engine.state_read import StateSource
from slotstate import seq_state
from slotstate.ggsq import pack_seq_file, read_seq_head, unpack_seq_file
from tests.conftest import CHAT
from tests.damaged_files import poisoned
from tests.engine.enginekit import Runner, llama_state, same_kv
from tests.engine.test_state_io import decode_together
from tests.tiny_models import build_tiny_gguf


def save_seq_file(engine, seq: int, path: Path) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """What the worker's ``SaveFile`` does (on its writer thread): ``(n_tokens, bytes written)``."""
    tokens, state = engine.save_state(seq)
    try:
        return len(tokens), write_slot_file(path, tokens, state)
    finally:
        engine.release_state(state)


def logits_finite(engine, seq: int, ids: list[int]) -> bool:  # type: ignore[no-untyped-def]
    """Decode ``ids`` in a fresh ``seq`` and say whether every logit of the last token is finite."""
    import llama_cpp as llama

    engine.erase(seq)
    assert engine.decode([BatchEntry(seq, 0, ids, logits=True)]) == 0
    out = np.ctypeslib.as_array(llama.llama_get_logits_ith(engine.ctx, -1), shape=(engine.model.n_vocab,))
    finite = bool(np.isfinite(out).all())
    engine.erase(seq)
    return finite


def test_a_saved_file_is_llama_cpps_and_loads_back_alike(runner: Runner, engine, model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """After concurrent decoding (cells interleaved): the file equals llama.cpp's format of the
    state, loads into another sequence byte for byte (K/V) and continues greedily alike."""
    decode_together(runner, model, n=6)
    path = tmp_path / "slot.bin"
    tokens, state = engine.save_state(1)
    n, size = save_seq_file(engine, 1, path)
    assert (n, size) == (len(tokens), path.stat().st_size)
    assert path.read_bytes() == pack_seq_file(tokens, bytes(state))
    assert not list(tmp_path.glob(".*.tmp")), "the file is written beside the target and renamed"
    engine.erase(2)  # seq 2 is loaded empty (in one pass), seq 3 holding cells (its values tested first)
    for seq in (2, 3):
        n2, size2, _ = load_seq_file(engine, seq, path)
        assert (n2, size2) == (len(tokens), size)
        assert engine.tokens[seq] == tokens
        assert same_kv(llama_state(engine.ctx, seq), llama_state(engine.ctx, 1))
    a = runner.generate(1, tokens, max_new_tokens=8, ignore_eos=True)
    for seq in (2, 3):
        b = runner.generate(seq, tokens, max_new_tokens=8, ignore_eos=True)
        assert b.done is not None and b.done.n_cached == len(tokens) - 1, "the loaded cells are used"
        assert a.tokens == b.tokens


def saved_and_poisoned(runner: Runner, engine, model, tmp_path: Path, record: int) -> tuple[list[int], Path, Path]:  # type: ignore[no-untyped-def]
    """Sequence 0 holding a short chat, saved as ``good.bin``, and ``bad.bin``: the same file with a NaN in
    state record ``record`` (K of layers 0-29, then V); the chat's token ids and both paths."""
    ids = model.tokenize(CHAT.format("Tell me about owls."), False, True)
    runner.generate(0, ids, max_new_tokens=4)
    runner.batcher.flush()
    good = tmp_path / "good.bin"
    save_seq_file(engine, 0, good)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(poisoned(good.read_bytes(), record))
    return ids, good, bad


@pytest.mark.parametrize("record", [0, 29, 30, 59], ids=["K0", "K29", "V0", "V29"])
def test_a_file_with_nan_values_is_refused_and_leaves_nothing_behind(
    runner: Runner, engine, model, tmp_path: Path, record: int
) -> None:  # type: ignore[no-untyped-def]
    """The values are tested after llama.cpp loaded them; the refused cells are zeroed, so no later
    decode of any sequence meets the NaN (a masked cell's V is still multiplied by its 0 weight)."""
    ids, good, bad = saved_and_poisoned(runner, engine, model, tmp_path, record)
    runner.generate(2, ids[:9], max_new_tokens=2)
    runner.batcher.flush()
    before = engine.tokens[2], llama_state(engine.ctx, 2)
    with pytest.raises(EngineError) as err:
        load_seq_file(engine, 2, bad)
    assert err.value.code == ErrorCode.BAD_STATE and "NaN" in err.value.message
    assert (engine.tokens[2], llama_state(engine.ctx, 2)) == before, "the sequence is as it was"
    assert logits_finite(engine, 3, ids[:20]), "no NaN left in the cache's cells"
    load_seq_file(engine, 2, good)  # the same cells take a good file afterwards
    assert engine.tokens[2] == engine.tokens[0]


@pytest.mark.parametrize("record", [0, 29, 30, 59], ids=["K0", "K29", "V0", "V29"])
@pytest.mark.parametrize("source", ["file", "memory"])
def test_nan_values_are_refused_while_an_empty_sequence_is_read(
    runner: Runner, engine, model, tmp_path: Path, record: int, source: str
) -> None:  # type: ignore[no-untyped-def]
    """An empty sequence takes a slot file (read from the file) or a received state (from memory) in one
    pass, libllama testing each block of values before it writes it: a NaN is refused naming its layer and
    K/V, the sequence stays empty, what was written before it is zeroed (decodes in the same KV stream
    stay finite), and the same cells take a good state afterwards."""
    ids, good, bad = saved_and_poisoned(runner, engine, model, tmp_path, record)
    assert not engine.tokens.get(2)
    with pytest.raises(EngineError) as err:
        if source == "file":
            load_seq_file(engine, 2, bad)
        else:
            parsed = unpack_seq_file(bad.read_bytes())
            engine.restore_state(2, parsed.tokens, parsed.state, check_values=True)
    n_layer = len(engine.layout.caches[0].layers)
    what, layer = ("K", record) if record < n_layer else ("V", record - n_layer)
    assert err.value.code == ErrorCode.BAD_STATE
    assert err.value.message.endswith(seq_state.nonfinite_message(what, layer)), err.value.message
    assert not engine.tokens.get(2) and seq_cells(engine.ctx, 2, 0, len(engine.tokens[0])).max() < 0
    assert logits_finite(engine, 2, ids[:20]), "no value of the refused state left in the stream's cells"
    load_seq_file(engine, 2, good)
    assert engine.tokens[2] == engine.tokens[0]
    assert same_kv(llama_state(engine.ctx, 2), llama_state(engine.ctx, 0))


@pytest.mark.parametrize("cut", ["at_a_page_boundary", "within_the_last_page"])
def test_a_file_cut_short_while_it_is_read_is_refused(runner: Runner, engine, model, tmp_path: Path, cut: str) -> None:  # type: ignore[no-untyped-def]
    """A file that loses its end after its structure was parsed (written over meanwhile) is refused, and the
    sequence stays empty; llama.cpp's own loader would abort.  libllama reads it through a mapping: cut at a page
    boundary, the first page past the new end raises SIGBUS when touched (mmap(2)), which libllama's handler turns
    into the refusal (unhandled, it would kill this process); cut within its last page, the rest of that page
    reads as zeros without a fault, and the file's size, tested before the piece's last bytes are used, refuses
    it.  The whole file loads afterwards."""
    ids = model.tokenize(CHAT.format("Count to ten."), False, True)
    runner.generate(0, ids, max_new_tokens=3)
    runner.batcher.flush()
    good = tmp_path / "good.bin"
    save_seq_file(engine, 0, good)
    with open(good, "rb") as f:
        tokens, _ = read_seq_head(f)
        start = f.tell()
        parsed = seq_state.parse_file(f, start, engine.layout)
    data = good.read_bytes()
    page = os.sysconf("SC_PAGE_SIZE")
    n_cut = len(data) - len(data) // 2 // page * page if cut == "at_a_page_boundary" else max(1, len(data) % page // 2)
    cut_path = tmp_path / "cut.bin"
    cut_path.write_bytes(data[:-n_cut])
    with open(cut_path, "rb") as f, pytest.raises(EngineError) as err:
        engine.restore_parsed(1, tokens, parsed, StateSource(fd=f.fileno(), start=start), check_values=True)
    assert err.value.code == ErrorCode.BAD_STATE and "ended inside" in err.value.message
    assert not engine.tokens.get(1) and seq_cells(engine.ctx, 1, 0, len(tokens)).max() < 0
    assert logits_finite(engine, 1, ids[:20])
    n, _, _ = load_seq_file(engine, 1, good)  # the same file whole afterwards: read as before
    assert n == len(tokens) and same_kv(llama_state(engine.ctx, 1), llama_state(engine.ctx, 0))


def test_damaged_and_missing_files_are_refused(runner: Runner, engine, model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ids = model.tokenize(CHAT.format("Count to ten."), False, True)
    runner.generate(0, ids, max_new_tokens=3)
    runner.batcher.flush()
    good = tmp_path / "good.bin"
    save_seq_file(engine, 0, good)
    data = good.read_bytes()
    before = list(engine.tokens.get(1, [])), llama_state(engine.ctx, 1)
    cases = {
        "cut.bin": data[:-100],
        "padded.bin": data + b"\0" * 8,
        "magic.bin": b"xxxx" + data[4:],
        "tokens.bin": data[:12] + struct.pack("<i", 10**7) + data[16:],  # the packed record's first word
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(EngineError) as err:
            load_seq_file(engine, 1, tmp_path / name)
        assert err.value.code == ErrorCode.BAD_STATE, name
        assert (list(engine.tokens.get(1, [])), llama_state(engine.ctx, 1)) == before, name
    with pytest.raises(EngineError) as err:
        load_seq_file(engine, 1, tmp_path / "missing.bin")
    assert err.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(EngineError) as err:
        save_seq_file(engine, 0, tmp_path)
    assert err.value.code == ErrorCode.INVALID_REQUEST
    assert logits_finite(engine, 3, ids[:20])


def test_a_file_of_several_kv_streams_goes_the_general_way(runner: Runner, engine, model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """llama-server ``-np 3`` without ``--kv-unified`` writes a record per stream (only its slot's
    holds cells); its record is restored into this engine's stream of the sequence."""
    ids = model.tokenize(CHAT.format("Name four rivers."), False, True)
    runner.generate(0, ids, max_new_tokens=3)
    runner.batcher.flush()
    tokens, state = engine.save_state(0)
    state = bytes(state)
    empty = (0).to_bytes(4, "little")
    three = state[:8] + (3).to_bytes(4, "little") + empty + state[12:] + empty
    path = tmp_path / "np3.bin"
    path.write_bytes(pack_seq_file(tokens, three))
    n, _, _ = load_seq_file(engine, 2, path)
    assert n == len(tokens) and engine.tokens[2] == tokens
    assert same_kv(llama_state(engine.ctx, 2), bytearray(state))


def test_a_state_being_written_is_not_reused_while_its_writer_reads_it(runner: Runner, engine, model) -> None:  # type: ignore[no-untyped-def]
    """The worker writes a slot file on another thread: the state it read must keep its bytes even when
    the sequence changes and other states are read meanwhile, until the writer hands it back."""
    decode_together(runner, model, n=4)
    tokens, lent = engine.save_state(1)
    kept = bytes(lent)
    engine.truncate(1, len(tokens) - 2)  # seq 1 changes
    engine.release_state(engine.save_state(2)[1])  # other reads take memory from the pool
    engine.release_state(engine.save_state(1)[1])
    assert bytes(lent) == kept, "the state being written was not written over"
    size = memoryview(lent).nbytes
    engine.release_state(lent)  # written: its memory serves the next read
    assert engine.state_pool.held_bytes >= size


@pytest.mark.parametrize("flash_attn", ["off", "on"])
@pytest.mark.parametrize(("arch", "n_prompt", "n_ctx"), [("gemma3", 600, 1024), ("gemma2", 4200, 4608)])
def test_a_sliding_window_models_file_maps_each_caches_record(
    tmp_path: Path, flash_attn: str, arch: str, n_prompt: int, n_ctx: int
) -> None:
    """Gemma-3-shaped (a global and a 512-token sliding-window KV cache; Gemma 2's 4,096-token window with a
    4,200-token prompt): a file of a prompt longer than the window and than a 512-token batch holds one
    record per cache, which libllama maps one after the
    other (the first unmapped before the second); both caches load back byte for byte into another sequence
    beside a third sequence holding cells, and the loaded sequence continues as the original does. The file's
    sliding cache holds the window and no more (llama.cpp's ``state_write`` leaves out masked cells): the
    prompt resent is cut by its last token and continued from the loaded cells, not prefilled again."""
    model = Model(build_tiny_gguf(arch, tmp_path))
    cfg = EngineSettings(n_ctx=n_ctx, n_slots=3, n_spare=1, n_threads=2, flash_attn=flash_attn)  # type: ignore[arg-type]
    eng = Engine(model, cfg)
    try:
        assert eng.memory.kind == "iswa"
        run = Runner(eng)
        prompt = [(7 * i) % (model.n_vocab - 10) + 5 for i in range(n_prompt)]
        run.generate(0, prompt, max_new_tokens=2)
        run.generate(2, prompt[::-1][:300], max_new_tokens=2)  # another sequence holding cells meanwhile
        path = tmp_path / "slot.bin"
        n, _ = save_seq_file(eng, 0, path)
        assert len(seq_state.parse(bytes(read_state(eng.ctx, 0, shape=eng.shape)[1]), shape=eng.shape).records) == 2
        n2, size, _ = load_seq_file(eng, 1, path)
        assert (n2, size) == (n, path.stat().st_size)
        loaded, original = (bytes(read_state(eng.ctx, s, shape=eng.shape)[1]) for s in (1, 0))
        assert same_kv(loaded, original, eng.shape)  # both caches' records
        tokens = list(eng.tokens[0])
        loaded_sliding = seq_cells(eng.ctx, 1, 0, len(tokens), cache=1) >= 0
        assert not loaded_sliding[: len(tokens) - eng.n_swa].any() and loaded_sliding[-eng.n_swa :].all()
        # the next token (position n) sees positions n - n_swa + 1 .. n - 1: a cut by one keeps them all
        assert eng.can_keep(1, len(tokens) - 1) and not eng.can_keep(1, len(tokens) - 2)
        a = run.generate(0, tokens, max_new_tokens=6, ignore_eos=True)
        b = run.generate(1, tokens, max_new_tokens=6, ignore_eos=True)
        assert b.done is not None and b.done.n_generated == 6 and a.tokens == b.tokens
        assert a.done is not None and a.done.n_cached == b.done.n_cached == len(tokens) - 1, "no prefill again"
    finally:
        eng.close()
        model.close()
