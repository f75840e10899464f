"""KV layout: one unified cache (slotserve) vs one KV stream per sequence (llama-server's default).

Measured side by side in one run at the llama.cpp level (the low-level ``llama_cpp`` API, as
engine/engine.py uses it), flash attention off in both (the attention capture needs the
``kq_soft_max`` nodes), on 4 slots + 2 spares + 1 scratch sequence:

- ``unified``: ``kv_unified=true``, ``n_ctx`` = (slots + 1) x the window; forks share cells;
- ``streams``: ``kv_unified=false``, one stream of one window per sequence (contiguous cells);
  ``seq_cp`` across streams copies the whole stream buffer (``src/llama-kv-cache.cpp``, ``seq_cp``).

Per layout: aggregate decode tok/s with 1, 2 and 4 sequences decoding together (``--prompt`` tokens
each, then ``--new`` steps of one token per sequence); ``llama_state_seq_get_data`` ms of sequence 0
decoded alone and after the 4 decoded together (their cells interleave in the unified cache);
``llama_state_seq_set_data`` ms of that state into free cells and, in the unified cache, into the
one-cell holes a parked sequence left; fork cost (``seq_cp`` + a one-token decode on the fork, minus
the same decode on the source); KV cache bytes.  Then slotserve's engine (unified, capture on): its
state read (engine/kv_io.py) beside llama.cpp's after 4 sequences decoded together, and a slot of
``--slot`` tokens: fresh prefill, save and restore before (llama.cpp's read; restore + re-read +
probe decode, the engine's path until this change) and now; with ``--llama-server PATH``, the same
slot through llama-server's slot files (``--slot-save-path``, ``POST /slots/0?action=save|restore``).

    .venv/bin/python benchmarks/bench_kv_layout.py [--n-gpu-layers 0] [--llama-server PATH]
        [--ctx 1024] [--prompt 256] [--new 32] [--slot 2000] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp as llama  # (before numpy: docs/hardware.md)
import numpy as np
from common import TEXT
from servers import default_model, free_port

from engine import seq_state
from engine.engine import BatchEntry, Engine
from engine.model import Model
from engine.settings import EngineSettings
from tests.engine.enginekit import llama_state

SLOTS, SPARE = 4, 2
N_SEQ = SLOTS + SPARE + 1


def ms(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn`` in ms over ``reps`` calls, after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


class Raw:
    """A bare llama.cpp context (no capture) in one of the two layouts."""

    def __init__(self, model: Model, unified: bool, window: int, threads: int) -> None:
        cp = llama.llama_context_default_params()
        cp.n_ctx = window * (SLOTS + 1) if unified else window * N_SEQ
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = N_SEQ
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = unified
        cp.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        self.ctx = llama.llama_init_from_model(model.ptr, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.n_cells = llama.llama_n_ctx(self.ctx)
        self.mem = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(512, 0, 1)

    def decode(self, entries: list[tuple[int, int, list[int]]]) -> None:
        """One ``llama_decode`` of ``(seq, pos0, tokens)`` entries (at most 512 tokens), logits of each last token."""
        b, i = self.batch, 0
        for seq, pos0, toks in entries:
            for j, t in enumerate(toks):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + j, 1, j == len(toks) - 1
                b.seq_id[i][0] = seq
                i += 1
        b.n_tokens = i
        if llama.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def prefill(self, seq: int, toks: list[int]) -> None:
        for k in range(0, len(toks), 512):
            self.decode([(seq, k, toks[k : k + 512])])

    def set_state(self, seq: int, blob: bytearray) -> None:
        src = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
        if llama.llama_state_seq_set_data(self.ctx, src, len(blob), seq) != len(blob):
            raise RuntimeError("llama_state_seq_set_data failed")

    def close(self) -> None:
        llama.llama_batch_free(self.batch)
        llama.llama_free(self.ctx)


def runs(cells: np.ndarray) -> int:
    c = np.sort(cells)
    return int(1 + np.count_nonzero(np.diff(c) != 1)) if len(c) else 0


def layout_figures(model: Model, unified: bool, a: argparse.Namespace, prompt: list[int]) -> dict:
    raw = Raw(model, unified, a.ctx, a.threads)
    out: dict = {"layout": "unified" if unified else "streams", "kv_cells": raw.n_cells}
    try:
        for n in (1, 2, 4):
            llama.llama_memory_clear(raw.mem, True)
            for s in range(n):
                raw.prefill(s, prompt[s:] + prompt[:s])  # different prompts, same length
            p = len(prompt)
            t0 = time.perf_counter()
            for k in range(a.new):
                raw.decode([(s, p + k, [prompt[k % p]]) for s in range(n)])
            out[f"decode_x{n}_tok_s"] = round(n * a.new / (time.perf_counter() - t0), 1)
            if n in (1, 4):
                key = "alone" if n == 1 else "after_4_together"
                out[f"get_ms_{key}"] = round(ms(lambda: llama_state(raw.ctx, 0), a.reps), 2)
        blob = llama_state(raw.ctx, 0)
        n_tok = len(prompt) + a.new
        out["state_bytes"] = len(blob)
        out["kv_mb"] = round(
            seq_state.parse(seq_state.single_stream(blob)).layout.bytes_per_cell() * raw.n_cells / 1e6, 1
        )

        def restore(seq: int) -> None:
            llama.llama_memory_seq_rm(raw.mem, seq, -1, -1)
            raw.set_state(seq, blob)

        out["set_ms_free_cells"] = round(ms(lambda: restore(5), a.reps), 2)
        llama.llama_memory_seq_rm(raw.mem, 5, -1, -1)
        if unified:  # a parked slot's one-cell holes: park seq 1, restore seq 0's state from cell 0 on
            llama.llama_memory_seq_rm(raw.mem, 1, -1, -1)

            def into_holes() -> None:
                llama.llama_memory_seq_rm(raw.mem, 6, -1, -1)
                llama.llama_memory_seq_add(raw.mem, 6, 0, -1, 1)  # head to cell 0 (engine.py does the same)
                raw.set_state(6, blob)

            out["set_ms_into_holes"] = round(ms(into_holes, a.reps), 2)
            llama.llama_memory_seq_rm(raw.mem, 6, -1, -1)
        base = ms(
            lambda: (raw.decode([(0, n_tok, [prompt[0]])]), llama.llama_memory_seq_rm(raw.mem, 0, n_tok, -1)), a.reps
        )

        def fork() -> None:
            llama.llama_memory_seq_rm(raw.mem, 4, -1, -1)
            llama.llama_memory_seq_cp(raw.mem, 0, 4, -1, -1)
            raw.decode([(4, n_tok, [prompt[0]])])

        out["fork_ms"] = round(ms(fork, a.reps) - base, 2)
        out["one_token_decode_ms"] = round(base, 2)
    finally:
        raw.close()
    return out


def engine_figures(model: Model, a: argparse.Namespace, prompt: list[int], slot: list[int]) -> dict:
    """slotserve's engine: fast reads after concurrent decoding; a long slot's save/restore before and now."""
    eng = Engine(
        model, EngineSettings(n_ctx=max(a.ctx, len(slot) + 16), n_slots=SLOTS, n_spare=SPARE, n_threads=a.threads)
    )
    out: dict = {"fast_reader": eng.reader.fast is not None}
    try:
        p = len(prompt)
        for s in range(4):
            for k in range(0, p, 512):
                assert eng.decode([BatchEntry(s, k, (prompt[s:] + prompt[:s])[k : k + 512])]) == 0
        for k in range(a.new):
            assert eng.decode([BatchEntry(s, p + k, [prompt[k % p]]) for s in range(4)]) == 0
        cells = eng.cellmap.cells(0)
        out["after_4_together"] = {
            "tokens": len(cells),
            "cell_runs": runs(cells),
            "llama_get_ms": round(ms(lambda: llama_state(eng.ctx, 0), a.reps), 2),
            "fast_read_ms": round(ms(lambda: eng.reader.read(0, eng.cellmap.cells(0)), a.reps), 2),
        }
        for s in range(4):
            eng.erase(s)
        t0 = time.perf_counter()
        for k in range(0, len(slot), 512):
            assert eng.decode([BatchEntry(0, k, slot[k : k + 512], logits=k + 512 >= len(slot))]) == 0
        prefill = (time.perf_counter() - t0) * 1000
        blob = llama_state(eng.ctx, 0)
        toks = list(eng.tokens[0])

        def old_restore() -> None:  # set_data + a re-read of the state + a one-token probe decode + seq_cp
            eng.erase(1)
            eng.erase(eng.scratch)
            src = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
            llama.llama_state_seq_set_data(eng.ctx, src, len(blob), eng.scratch)
            llama_state(eng.ctx, eng.scratch)
            b = eng.batch  # the probe: one token after the state (capture disarmed: no mirror update)
            b.token[0], b.pos[0], b.n_seq_id[0], b.logits[0] = toks[0], len(toks), 1, 1
            b.seq_id[0][0] = eng.scratch
            b.n_tokens = 1
            llama.llama_decode(eng.ctx, b)
            llama.llama_memory_seq_rm(eng.mem, eng.scratch, len(toks), -1)
            llama.llama_memory_seq_cp(eng.mem, eng.scratch, 1, -1, -1)
            eng.erase(eng.scratch)
            eng.cellmap.remove(1)
            eng.tokens.pop(1, None)

        def new_restore() -> None:
            eng.erase(1)
            eng.restore_state(1, toks, blob)

        out[f"slot_{len(slot)}"] = {
            "state_mb": round(len(blob) / 1e6, 1),
            "prefill_ms": round(prefill, 1),
            "save_ms_before": round(ms(lambda: llama_state(eng.ctx, 0), a.reps), 2),
            "save_ms_now": round(ms(lambda: eng.reader.read(0, eng.cellmap.cells(0)), a.reps), 2),
            "restore_ms_before": round(ms(old_restore, a.reps), 2),
            "restore_ms_now": round(ms(new_restore, a.reps), 2),
        }
    finally:
        eng.close()
    return out


def llama_server_figures(a: argparse.Namespace, slot: list[int]) -> dict:
    """llama-server -np 1 with --slot-save-path: prefill of the slot, then its slot file saved and restored."""
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="kvlayout-"))
    port = free_port()
    cmd = [str(a.llama_server), "-m", str(a.model), "--port", str(port), "-np", "1", "-c", str(len(slot) + 256),
           "-t", str(a.threads), "--slot-save-path", str(tmp), "--n-gpu-layers", str(a.n_gpu_layers)]  # fmt: skip
    log = open(tmp / "llama-server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    out: dict = {}
    try:
        with httpx.Client(timeout=600) as c:
            for _ in range(600):
                try:
                    if c.get(base + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            body = {"prompt": slot, "n_predict": 1, "cache_prompt": True, "id_slot": 0, "temperature": 0}
            r = c.post(base + "/completion", json=body).json()
            out["prefill_ms"] = round(r["timings"]["prompt_ms"], 1)
            saves, restores, walls = [], [], []
            for i in range(a.reps):
                t0 = time.perf_counter()
                s = c.post(base + "/slots/0", params={"action": "save"}, json={"filename": f"s{i}.bin"}).json()
                walls.append((time.perf_counter() - t0) * 1000)
                saves.append(s["timings"]["save_ms"])
                q = c.post(base + "/slots/0", params={"action": "restore"}, json={"filename": f"s{i}.bin"}).json()
                restores.append(q["timings"]["restore_ms"])
            out["file_mb"] = round(os.path.getsize(tmp / "s0.bin") / 1e6, 1)
            out["save_ms"] = round(statistics.median(saves), 2)
            out["restore_ms"] = round(statistics.median(restores), 2)
            out["save_wall_ms"] = round(statistics.median(walls), 2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary for the slot-file figures")
    ap.add_argument("--ctx", type=int, default=1024, help="context window per sequence (tokens)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=32, help="decode steps")
    ap.add_argument("--slot", type=int, default=2000, help="tokens of the long slot (0: skip)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    a.model = a.model or default_model()
    model = Model(a.model, n_gpu_layers=a.n_gpu_layers)
    text = model.tokenize(TEXT * 40, False, False)
    prompt, slot = text[: a.prompt], text[: a.slot]
    print(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(), "load": os.getloadavg()[0]}))
    for unified in (True, False):
        print(json.dumps(layout_figures(model, unified, a, prompt)), flush=True)
    print(json.dumps({"engine": engine_figures(model, a, prompt, slot if a.slot else prompt)}), flush=True)
    if a.llama_server and a.slot:
        print(json.dumps({"llama_server": llama_server_figures(a, slot)}), flush=True)
    print(json.dumps({"load_after": os.getloadavg()[0]}))
    model.close()


if __name__ == "__main__":
    main()
