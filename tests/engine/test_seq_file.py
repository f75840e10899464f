"""Our ``ggsq`` files are byte for byte what llama.cpp's ``llama_state_seq_save_file`` writes,
and ``llama_state_seq_load_file`` reads them back."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as llama
import pytest

from engine import seq_state
from engine.engine import BatchEntry
from storage.ggsq import pack_seq_file, unpack_seq_file


def test_file_equals_llama_cpp_save_file(engine, model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    seq = 2
    toks = model.tokenize("The quick brown fox jumps over the lazy dog.", True, False)
    engine.erase(seq)
    assert engine.decode([BatchEntry(seq, 0, toks, logits=True)]) == 0
    try:
        tokens, state = engine.save_state(seq)
        ours = pack_seq_file(tokens, bytes(state))
        # llama-server passes the packed token record as the "tokens" of llama_state_seq_save_file
        n_words = int.from_bytes(ours[8:12], "little")
        words = (ctypes.c_int32 * n_words).from_buffer_copy(ours, 12)
        path = tmp_path / "ref.bin"
        written = llama.llama_state_seq_save_file(engine.ctx, str(path).encode(), seq, words, n_words)
        assert written == len(ours) and path.read_bytes() == ours

        parsed = unpack_seq_file(ours)
        assert parsed.tokens == tokens
        out = (ctypes.c_int32 * n_words)()
        n_out = ctypes.c_size_t(0)
        scratch = engine.scratch
        engine.erase(scratch)
        read = llama.llama_state_seq_load_file(engine.ctx, str(path).encode(), scratch, out, n_words,
                                               ctypes.byref(n_out))  # fmt: skip
        assert read == len(ours) and n_out.value == n_words
        assert llama.llama_memory_seq_pos_max(engine.mem, scratch) == len(toks) - 1
    finally:
        llama.llama_memory_seq_rm(engine.mem, engine.scratch, -1, -1)
        engine.erase(seq)


def test_state_of_several_streams_becomes_one(engine, model) -> None:  # type: ignore[no-untyped-def]
    """llama-server with ``-np 3`` and no ``--kv-unified`` writes one record per stream; only its
    slot's stream has cells.  ``single_stream`` keeps that record: the state this engine wrote."""
    seq = 2
    engine.erase(seq)
    assert engine.decode([BatchEntry(seq, 0, model.tokenize("Hello there", False, False), logits=True)]) == 0
    try:
        _, state = engine.save_state(seq)
        state = bytes(state)
        head, record = state[:8], state[12:]
        empty = (0).to_bytes(4, "little")
        three = head + (3).to_bytes(4, "little") + empty + record + empty
        assert seq_state.single_stream(three) == state
        assert seq_state.single_stream(state) == state
        with pytest.raises(seq_state.BadStateError, match="spread over 2"):
            seq_state.single_stream(head + (2).to_bytes(4, "little") + record + record)
        with pytest.raises(seq_state.BadStateError):
            seq_state.single_stream(three[:-5])
    finally:
        engine.erase(seq)
