"""Each pass of a slot's state between the KV cache and memory or a slot file, in process, beside llama.cpp's own
file functions (what llama-server's ``?action=save|restore`` calls): where the time of a save or a restore goes.

One engine (``--flash-attn``: ``on`` stores V by rows, llama-server's CPU default; ``off`` transposed, slotserve's),
a ``--tokens``-token sequence; each row is the median (and minimum) of ``--reps`` calls in ms, ``os.sync()`` before
each so no write waits on the last one's dirty pages:

* save: ``Engine.save_state`` (``llama_state_seq_get_data`` into a pooled buffer), a slot file as the worker writes
  it (that, then ``engine.state_file.write_slot_file``), ``llama_state_seq_save_file``;
* restore: ``llama_state_seq_load_file``, ``engine.state_file.load_seq_file`` into an empty sequence (one pass:
  ``llama_attn_state_seq_read`` from the file, values tested as they are written) and into one holding cells (read
  into a pooled buffer, tested, then restored), and the passes of the latter: the read, ``seq_state.parse``,
  ``seq_state.check_finite``, ``Engine.restore_state`` from memory without and with the values tested.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_state_passes.py --flash-attn on
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import common  # also puts the checkout on sys.path
import llama_cpp as llama  # llama.cpp before numpy (docs/hardware.md)
from servers import default_model

from contract.settings import EngineSettings
from engine.batch import BatchEntry
from engine.engine import Engine
from engine.model import Model
from engine.state_file import load_seq_file, write_slot_file
from slotstate import seq_state
from slotstate.ggsq import read_seq_file


def timed(label: str, fn: Callable[[], object], reps: int) -> None:
    """Print the median and minimum ms of ``reps`` calls of ``fn``."""
    xs = []
    for _ in range(reps):
        os.sync()
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1000)
    print(f"{label:52s} {statistics.median(xs):7.1f} ms (min {min(xs):.1f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flash-attn", default="on", choices=("on", "off"))
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"machine: {common.machine()}; {common.load()}; flash attention {args.flash_attn}")
    model = Model(default_model())
    settings = EngineSettings(n_ctx=4096, n_slots=4, n_spare=2, n_threads=args.threads, flash_attn=args.flash_attn)
    eng = Engine(model, settings)
    toks = model.tokenize("The quick brown fox jumps over the lazy dog. " * (args.tokens // 8), False, False)
    toks = toks[: args.tokens]
    eng.decode_in_batches(BatchEntry(0, 0, toks, logits=True))
    tmp = Path(tempfile.mkdtemp(prefix="state-passes-"))
    ours, theirs = tmp / "slotserve.bin", tmp / "llama.bin"
    ids = (llama.llama_token * len(toks))(*toks)
    out, n_out = (llama.llama_token * (2 * len(toks)))(), ctypes.c_size_t()

    def save_state() -> None:
        eng.release_state(eng.save_state(0)[1])

    def save_file() -> None:
        tokens, state = eng.save_state(0)
        try:
            write_slot_file(ours, tokens, state)
        finally:
            eng.release_state(state)

    def llama_load() -> None:
        eng.erase(1)
        assert llama.llama_state_seq_load_file(eng.ctx, str(theirs).encode(), 1, out, len(out), ctypes.byref(n_out))

    def load_empty() -> None:
        eng.erase(1)
        load_seq_file(eng, 1, ours)

    timed("save: Engine.save_state", save_state, args.reps)
    timed("save: slot file (save_state + write_slot_file)", save_file, args.reps)
    timed("save: llama_state_seq_save_file", lambda: llama.llama_state_seq_save_file(
        eng.ctx, str(theirs).encode(), 0, ids, len(toks)), args.reps)  # fmt: skip
    timed("restore: llama_state_seq_load_file", llama_load, args.reps)
    timed("restore: load_seq_file, empty sequence (one pass)", load_empty, args.reps)
    timed("restore: load_seq_file, sequence holding cells", lambda: load_seq_file(eng, 1, ours), args.reps)
    with open(ours, "rb") as f:

        def read() -> None:
            f.seek(0)
            eng.state_pool.give(eng.state_pool.fill(lambda take: read_seq_file(f, take)).state)

        timed("  its passes: the file read into a pooled buffer", read, args.reps)
        f.seek(0)
        got = read_seq_file(f)
    state = bytes(got.state)
    parsed = seq_state.parse(state, eng.layout)
    timed("  seq_state.parse", lambda: seq_state.parse(state, eng.layout), args.reps)
    timed("  seq_state.check_finite", lambda: seq_state.check_finite(state, parsed), args.reps)
    for check in (False, True):

        def restore(check: bool = check) -> None:
            eng.erase(1)
            eng.restore_state(1, got.tokens, state, check_values=check)

        timed(f"restore: Engine.restore_state from memory, values tested {check}", restore, args.reps)
    print(f"{len(toks)} tokens, state {len(state) / 1e6:.1f} MB; at the end: {common.load()}")
    eng.close()


if __name__ == "__main__":
    main()
