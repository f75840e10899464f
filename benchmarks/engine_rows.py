"""The in-process rows of ``bench_table.py``: engines in the benchmark's own process (no servers running).

Decode tok/s without the eval callback, with full attention captured (f16 KV cache) and with an f32 KV
cache; the state read (``llama_state_seq_get_data``) of a slot after 4 sequences decoded together vs the
same slot decoded alone; attention vs transformers' eager float32 reference (``tests/engine/hf_reference.py``),
f16 vs f32 KV cache, skipped without torch/transformers/gguf.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import time
from collections.abc import Callable

import common  # noqa: F401 - puts the checkout on sys.path
import llama_cpp as llama  # llama.cpp before numpy (docs/hardware.md)
from bench_stream import inproc_once
from common import Quiet, build_prompt, median, model_tokenizer, step_tps
from servers import default_model

from engine.engine import Engine
from engine.heap import keep_heap_mapped
from engine.model import Model
from engine.settings import EngineSettings
from tests.conftest import CHAT
from tests.engine.enginekit import Runner

Add = Callable[[str, str], None]
"""``add(row, slotserve's figure)``: one row of the table."""


def in_process(args: argparse.Namespace, quiet: Quiet, add: Add) -> None:
    """Row 6: engines in this process (no servers running), with the worker's heap settings."""
    keep_heap_mapped()
    model = Model(args.model or default_model(), n_gpu_layers=args.n_gpu_layers)
    tok = model_tokenizer(model)
    engines: dict[str, Engine] = {}
    try:
        for name, capture, kv in (("no eval callback", False, "f16"), ("capture, f16 KV", True, "f16"),
                                  ("capture, f32 KV", True, "f32")):  # fmt: skip
            cfg = EngineSettings(
                n_ctx=args.inproc_ctx,
                n_slots=4,
                n_spare=1,
                n_threads=args.threads,
                capture=capture,
                type_k=kv,
                type_v=kv,
            )
            engines[name] = Engine(model, cfg)
        ids = build_prompt(tok, args.prompt)
        ns = argparse.Namespace(new=args.new)
        tps: dict[str, list[float]] = {name: [] for name in engines}
        gaps: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.reps + 1):
            for name, eng in engines.items():
                rep = quiet.run(lambda eng=eng: inproc_once(eng, ids, ns, quiet.meter), name, warm=r == 0)[0]
                print(f"  rep {r} in-process {name}: {rep.tps:.1f} tok/s", flush=True)
                if r:
                    tps[name].append(rep.tps)
                    gaps[name] += rep.gaps
        raw, f16, f32 = (median(tps[n]) for n in engines)
        add("in-process decode tok/s: capture (f16 KV) / no eval callback", f"{f16:.1f} / {raw:.1f} = {f16 / raw:.3f}")
        s_raw, s_f16 = step_tps(gaps["no eval callback"]), step_tps(gaps["capture, f16 KV"])
        add(
            "in-process decode tok/s from the median token step: capture (f16 KV) / no eval callback",
            f"{s_f16:.1f} / {s_raw:.1f} = {s_f16 / s_raw:.3f}",
        )
        add("in-process decode tok/s with capture: f32 KV / f16 KV", f"{f32:.1f} / {f16:.1f} = {f32 / f16:.3f}")
        state_reads(args, quiet, add, engines["capture, f16 KV"], tok)
        reference(args, add, model, engines)
    finally:
        for eng in engines.values():
            eng.close()
        model.close()


def state_reads(args: argparse.Namespace, quiet: Quiet, add: Add, eng: Engine, tok) -> None:  # type: ignore[no-untyped-def]
    """The state read of sequence 0 after 4 sequences decoded together vs after sequence 0 decoded alone:
    llama.cpp's ``llama_state_seq_get_data`` and ``Engine.save_state`` (its own copy dropped first, so it
    reads: from the KV tensors where the cell mirror knows the cells, ``engine/kv_io.py``)."""
    prompts = [build_prompt(tok, args.stream_prompt, variant=i + 1) for i in range(4)]
    times: dict[tuple[str, int], list[float]] = {}
    n_tok = size = 0
    for r in range(args.reps + 1):
        for n in (4, 1):
            for seq in range(4):
                eng.erase(seq)
            runner = Runner(eng)
            for seq in range(n):
                runner.submit(seq, prompts[seq], max_new_tokens=args.new, ignore_eos=True)
            runner.run()
            runner.batcher.flush(0)  # the last sampled token, as the worker does before a save

            def llama_read() -> tuple[float, int, int]:
                t0 = time.perf_counter()
                size = llama.llama_state_seq_get_size(eng.ctx, 0)
                buf = bytearray(size)
                got = llama.llama_state_seq_get_data(eng.ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, 0)
                assert got == size
                return (time.perf_counter() - t0) * 1000, eng.seq_len(0), size

            def engine_read() -> tuple[float, int, int]:
                eng._drop_state(0)  # measure the read, not the kept copy
                t0 = time.perf_counter()
                _, state = eng.save_state(0)
                ms = (time.perf_counter() - t0) * 1000
                return ms, eng.seq_len(0), memoryview(state).nbytes

            for name, fn in (("llama_state_seq_get_data", llama_read), ("Engine.save_state", engine_read)):
                ms, n_tok, size = quiet.run(fn, "state read", warm=r == 0)[0]
                print(f"  rep {r} {name} after {n} sequence(s): {ms:.2f} ms", flush=True)
                if r:
                    times.setdefault((name, n), []).append(ms)
    for name in ("Engine.save_state", "llama_state_seq_get_data"):
        tg, al = median(times[(name, 4)]), median(times[(name, 1)])
        add(
            f"state read ({name}), {n_tok}-token slot ({size / 1e6:.1f} MB): after 4 decoded together / alone",
            f"{tg:.1f} / {al:.1f} ms = {tg / al:.1f}",
        )
    for seq in range(4):
        eng.erase(seq)


def reference(args: argparse.Namespace, add: Add, model: Model, engines: dict[str, Engine]) -> None:
    """Attention of 8 greedy tokens vs transformers' eager float32 attention, f16 and f32 KV cache."""
    missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        add("attention vs transformers eager fp32", f"skipped: {', '.join(missing)} not installed")
        return
    from tests.engine.hf_reference import generated_rows_vs_reference, load_reference, reference_forward

    prompt = model.tokenize(CHAT.format("What is the capital of France?"), False, True)
    res = {}
    for name in ("capture, f16 KV", "capture, f32 KV"):
        engines[name].erase(0)
        res[name] = Runner(engines[name]).generate(0, prompt, max_new_tokens=8, ignore_eos=True)
        engines[name].erase(0)
    ids = prompt + res["capture, f32 KV"].tokens
    att, _ = reference_forward(load_reference(model.path), ids)
    for name, r in res.items():
        corr, mad = generated_rows_vs_reference(r.attention, att, len(prompt))
        add(
            f"attention vs transformers eager fp32 ({name}, {len(prompt)}-token prompt, 8 tokens)",
            f"min per-head corr {corr:.4f}, worst head mean abs diff {mad:.4f}",
        )
