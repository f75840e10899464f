"""The in-process rows of ``bench_table.py``: engines in the benchmark's own process (no servers running).

How the capture's cost grows with the context: one sequence holding ``--growth`` contexts (500, 2000,
4000, 8000 tokens by default) generates ``--new`` tokens from its cached context without attention, with
aggregated attention (the mean over layers and heads, computed in llama.cpp's graph) and with full
per-layer attention; decode tok/s from the median token step and the attention bytes per token. Then
attention vs transformers' eager float32 reference (``tests/engine/hf_reference.py``), f16 vs f32 KV cache,
flash attention on and off, skipped without torch/transformers/gguf.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import common
import llama_cpp  # noqa: F401 - llama.cpp before numpy (docs/hardware.md)
import numpy as np
from common import Quiet, build_prompt, model_tokenizer, step_tps
from servers import default_model

from contract.heap import keep_heap_mapped
from contract.options import CaptureOptions, SamplingParams
from contract.protocol import Error, Generate, Token
from contract.settings import EngineSettings
from engine.batcher import Batcher
from engine.engine import Engine
from engine.model import Model
from tests.conftest import CHAT
from tests.engine.enginekit import Runner

Add = Callable[[str, str], None]
"""``add(row, slotserve's figure)``: one row of the table."""

MODES = {
    "no attention": CaptureOptions(),
    "aggregated": CaptureOptions(attention=True, format="aggregated"),
    "full per-layer": CaptureOptions(attention=True),
}


def in_process(args: argparse.Namespace, quiet: Quiet, add: Add) -> None:
    """Engines in this process (no servers running), with the worker's heap settings."""
    keep_heap_mapped()
    model = Model(args.model or default_model(), n_gpu_layers=args.n_gpu_layers)
    try:
        growth(args, quiet, add, model)
        reference(args, add, model)
    finally:
        model.close()


def decode_steps(eng: Engine, ids: list[int], new: int, cap: CaptureOptions) -> tuple[list[float], int]:
    """``(token step gaps in s, attention bytes of the last token)`` of one generation of ``new`` tokens on
    sequence 0 from ``ids`` (cached but for its last token)."""
    times: list[float] = []
    nbytes = [0]
    bad: list[object] = []

    def emit(msg: object, bufs: object) -> None:
        if isinstance(msg, Token):
            times.append(time.perf_counter())
            nbytes[0] = msg.attention.nbytes if msg.attention is not None else 0
        elif isinstance(msg, Error):
            bad.append(msg)

    b = Batcher(eng, emit)
    b.submit(Generate(1, 0, "generate", ids, SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True), cap))
    while b.has_work():
        b.step()
    if bad:
        raise RuntimeError(f"in-process: {bad[0]}")
    return common.token_gaps(times), nbytes[0]


def growth(args: argparse.Namespace, quiet: Quiet, add: Add, model: Model) -> None:
    """Decode tok/s and bytes per token without attention, aggregated and full, per context size."""
    sizes = [int(x) for x in args.growth.split(",")]
    cfg = EngineSettings(
        n_ctx=max(sizes) + args.new + 256,
        n_slots=1,
        n_spare=0,
        n_threads=args.threads,
        flash_attn=args.flash_attn,
        capture_graph=args.capture_graph,
    )
    eng = Engine(model, cfg)
    tok = model_tokenizer(model)
    try:
        for n in sizes:
            ids = build_prompt(tok, n)
            eng.erase(0)
            Runner(eng).generate(0, ids, max_new_tokens=0)  # prefill once; every rep starts from it
            gaps: dict[str, list[float]] = {m: [] for m in MODES}
            size: dict[str, int] = {}
            for r in range(args.reps + 1):
                for mode, cap in MODES.items():
                    (g, nb), _ = quiet.run(
                        lambda cap=cap, ids=ids: decode_steps(eng, ids, args.new, cap), f"{n} {mode}", warm=r == 0
                    )
                    print(f"  rep {r} {n} tokens, {mode}: {step_tps(g):.1f} tok/s", flush=True)
                    if r:
                        gaps[mode] += g
                        size[mode] = nb
            base = step_tps(gaps["no attention"])
            cells = []
            for mode in MODES:
                tps = step_tps(gaps[mode])
                cells.append(
                    f"{mode} {tps:.1f}"
                    + (f" ({tps / base:.3f}, {size[mode] / 1e3:.1f} kB/token)" if size[mode] else "")
                )
            fa = "on" if eng.flash_attn else "off"
            add(f"in-process decode tok/s at {n} tokens of context (flash attention {fa})", "; ".join(cells))
    finally:
        eng.close()


def reference(args: argparse.Namespace, add: Add, model: Model) -> None:
    """Attention of 8 greedy tokens vs transformers' eager float32 attention: f16 and f32 KV cache, flash
    attention on and off."""
    missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        add("attention vs transformers eager fp32", f"skipped: {', '.join(missing)} not installed")
        return
    prompt = model.tokenize(CHAT.format("What is the capital of France?"), False, True)
    res = {}
    for kv in ("f16", "f32"):
        for fa in ("on", "off"):
            cfg = EngineSettings(
                n_ctx=512, n_slots=1, n_spare=0, n_threads=args.threads, type_k=kv, type_v=kv, flash_attn=fa
            )
            eng = Engine(model, cfg)
            try:
                res[f"{kv} KV, flash attention {fa}"] = Runner(eng).generate(
                    0, prompt, max_new_tokens=8, ignore_eos=True
                )
            finally:
                eng.close()
    ref = res["f32 KV, flash attention off"]
    same = {name: r for name, r in res.items() if r.tokens == ref.tokens}
    stats = reference_stats(model.path, prompt + ref.tokens, len(prompt), [r.attention for r in same.values()])
    for name in res:
        if name not in same:
            add(f"attention vs transformers eager fp32 ({name})", "greedy tokens differ from the reference run's")
            continue
        corr, mad = stats[list(same).index(name)]
        add(
            f"attention vs transformers eager fp32 ({name}, {len(prompt)}-token prompt, 8 tokens)",
            f"min per-head corr {corr:.4f}, worst head mean abs diff {mad:.4f}",
        )


def reference_stats(
    model_path: Path | str, ids: list[int], n_prompt: int, runs: list[list[np.ndarray]]
) -> list[tuple[float, float]]:
    """``generated_rows_vs_reference``'s ``(corr, mad)`` of each run's attention rows, from
    ``hf_reference_child.py`` in a child process: torch must not load beside llama.cpp (it aborts or
    crashes on the GPU machine)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    arrays: dict[str, np.ndarray] = {
        "model": np.array(str(model_path)),
        "ids": np.array(ids, dtype=np.int64),
        "n_prompt": np.array(n_prompt),
        "n_runs": np.array(len(runs)),
    }
    for i, rows in enumerate(runs):
        for k, row in enumerate(rows):
            arrays[f"rows_{i}_{k}"] = np.asarray(row)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(src, **arrays)
        child = Path(__file__).with_name("hf_reference_child.py")
        subprocess.run([sys.executable, str(child), str(src), str(dst)], check=True, env=env, cwd=root)
        with np.load(dst) as out:
            return [(float(c), float(m)) for c, m in zip(out["corr"], out["mad"], strict=True)]
