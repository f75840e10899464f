"""Our ``ggsq`` files are byte for byte what llama.cpp's ``llama_state_seq_save_file`` writes,
and ``llama_state_seq_load_file`` reads them back."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as llama
import pytest

from engine.batch import BatchEntry
from slotstate import seq_state
from slotstate.ggsq import pack_seq_file, unpack_seq_file
from tests.engine.enginekit import llama_state, same_kv


def decoded(engine, model, seq: int) -> list[int]:  # type: ignore[no-untyped-def]
    """A short sentence decoded into ``seq`` (emptied first); its token ids."""
    toks = model.tokenize("The quick brown fox jumps over the lazy dog.", True, False)
    engine.erase(seq)
    assert engine.decode([BatchEntry(seq, 0, toks, logits=True)]) == 0
    return list(toks)


def test_file_is_llama_cpp_save_file_in_the_one_stream_form(engine, model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``llama_state_seq_save_file`` of this engine (one KV stream per sequence) writes a record per
    stream; our file is the same file with the state in the one-stream form (what a unified cache
    or llama-server ``-np 1`` writes), and both restore to the same sequence."""
    seq, other = 2, 3
    toks = decoded(engine, model, seq)
    try:
        tokens, state = engine.save_state(seq)
        ours = pack_seq_file(tokens, bytes(state))
        # llama-server passes the packed token record as the "tokens" of llama_state_seq_save_file
        n_words = int.from_bytes(ours[8:12], "little")
        words = (ctypes.c_int32 * n_words).from_buffer_copy(ours, 12)
        path = tmp_path / "ref.bin"
        written = llama.llama_state_seq_save_file(engine.ctx, str(path).encode(), seq, words, n_words)
        theirs = path.read_bytes()
        assert written == len(theirs)
        head = 12 + 4 * n_words
        assert theirs[:head] == ours[:head], "magic, version and token record"
        mine = bytearray(bytes(state[:8]) + theirs[head:])  # with the io header a ggsq file leaves out
        assert bytes(seq_state.one_stream(mine)[8:]) == ours[head:]
        parsed = unpack_seq_file(ours)
        assert parsed.tokens == tokens
        engine.restore_state(other, tokens, bytes(state))
        assert same_kv(llama_state(engine.ctx, other), llama_state(engine.ctx, seq))
        out = (ctypes.c_int32 * n_words)()
        n_out = ctypes.c_size_t(0)
        engine.erase(other)
        read = llama.llama_state_seq_load_file(engine.ctx, str(path).encode(), other, out, n_words,
                                               ctypes.byref(n_out))  # fmt: skip
        assert read == len(theirs) and n_out.value == n_words
        assert llama.llama_memory_seq_pos_max(engine.mem, other) == len(toks) - 1
    finally:
        engine.erase(other)
        engine.erase(seq)


def test_a_state_of_several_streams_is_read_as_it_is(engine, model) -> None:  # type: ignore[no-untyped-def]
    """llama-server with ``-np 3`` and no ``--kv-unified`` writes one record per stream; only its
    slot's stream has cells.  Such a state parses (and restores) as it is; cells in two streams do not."""
    seq = 2
    engine.erase(seq)
    assert engine.decode([BatchEntry(seq, 0, model.tokenize("Hello there", False, False), logits=True)]) == 0
    try:
        tokens, state = engine.save_state(seq)
        state = bytes(state)
        head, record = state[:8], state[12:]
        empty = (0).to_bytes(4, "little")
        three = head + (3).to_bytes(4, "little") + empty + record + empty
        parsed = seq_state.parse(three, engine.layout)
        assert parsed.n_stream == 3 and len(parsed.positions) == len(tokens)
        assert bytes(seq_state.one_stream(bytearray(three))) == state
        engine.restore_state(seq, tokens, three, check_values=True)
        assert bytes(engine.save_state(seq)[1]) == state
        with pytest.raises(seq_state.BadStateError, match="spread over several"):
            seq_state.parse(head + (2).to_bytes(4, "little") + record + record)
        with pytest.raises(seq_state.BadStateError):
            seq_state.parse(three[:-5])
    finally:
        engine.erase(seq)


def test_a_files_structure_is_read_as_the_same_bytes_in_memory(engine, model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``parse_file`` (small ``pread``s, no memory map: a file written over meanwhile is a short read, never a
    SIGBUS) finds what ``parse`` finds in the same bytes, and refuses the file cut short."""
    seq = 2
    decoded(engine, model, seq)
    try:
        tokens, state = engine.save_state(seq)
        data = pack_seq_file(tokens, bytes(state))
    finally:
        engine.erase(seq)
    path = tmp_path / "slot.bin"
    path.write_bytes(b"x" * 100 + data)  # the state from a byte that is not the file's first
    start = 100 + len(data) - (len(bytes(state)) - 8)
    in_memory = seq_state.parse(memoryview(data)[start - 100 :], engine.layout, io_header=False)
    with open(path, "rb") as f:
        from_file = seq_state.parse_file(f, start, engine.layout)
    assert from_file.data == in_memory.data and from_file.records == in_memory.records
    assert from_file.layout == in_memory.layout and list(from_file.positions) == list(in_memory.positions)
    for cut in (1, 7, len(data) // 2):
        path.write_bytes((b"x" * 100 + data)[:-cut])
        with open(path, "rb") as f, pytest.raises(seq_state.BadStateError):
            seq_state.parse_file(f, start, engine.layout)
