"""Prefill and decode speed with llama.cpp's CPU extra buffer types (weight repacking) on and off.

Loads the model twice in one process, once with ``use_extra_bufts`` on and once off
(llama-server's ``--no-repack``), builds the engine as ``slotserve serve`` does (attention
capture armed), and measures, reps interleaved so drift hits both alike:

- prefill: a ``--ctx``-token prompt from scratch to the first token (tok/s over the prompt),
- decode: ``--new`` tokens, ``(n - 1) / (t_last - t_first)``, every token's full attention
  requested (as a Halo Weave client asks).

It prints the CPU's extra buffer types and the engine's automatic choice on this host.
``--requantize q4_0`` first requantizes the model with llama.cpp's own quantizer
(``llama_model_quantize``) into a temporary file: x86's ``CPU_REPACK`` has kernels for
Q4_0 (not for the default model's Q4_1), so this shows what repacking is worth where it applies.

    .venv/bin/python benchmarks/bench_repack.py [--ctx 500] [--new 64] [--reps 3] [--threads 2] [--requantize q4_0]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401 - puts the checkout on sys.path, for the engine imports below
import llama_cpp as llama
from bench_stream import Phase, build_prompt, inproc_once, take_rep
from common import Quiet, add_idle_args

from contract.settings import EngineSettings
from engine import backend
from engine.engine import Engine
from engine.model import Model, default_model_path, init_backend


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=500, help="prompt length (tokens)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions per configuration (+1 warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--n-ctx", type=int, default=2048, help="context window per slot")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--requantize", choices=sorted(FTYPES), default=None, help="requantize the model first")
    add_idle_args(ap)
    args = ap.parse_args()
    args.spare = 1
    if args.new < 2:
        ap.error("--new must be >= 2")

    init_backend()
    extra = backend.cpu_extra_bufts()
    auto = backend.choose_repack(None, extra)
    flags = backend.cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]
    print(f"CPU flags of note: {isa}; extra buffer types: {extra}; engine default: {auto.reason}")
    path = args.model or default_model_path()
    tmp = tempfile.TemporaryDirectory(prefix="bench-repack-")
    if args.requantize:
        path = requantize(path, Path(tmp.name) / f"model-{args.requantize}.gguf", FTYPES[args.requantize], args.threads)
    configs: list[tuple[Phase, Model, Engine]] = []
    quiet = Quiet(args)
    try:
        for on in (True, False):
            model = Model(path, repack=backend.RepackChoice(on, "benchmark"))
            cfg = EngineSettings(n_ctx=args.n_ctx, n_slots=1, n_spare=1, n_threads=args.threads)
            configs.append((Phase(f"repack {'on ' if on else 'off'}"), model, Engine(model, cfg)))
        ids = build_prompt(configs[0][1], args.ctx)
        print(f"model {path.name}, prompt {len(ids)} tokens, {args.new} new, {args.threads} threads")
        for r in range(args.reps + 1):  # rep 0 is a warm-up
            for phase, _, eng in configs:
                take_rep(phase, r, lambda eng=eng: inproc_once(eng, ids, args, quiet.meter), quiet)
    finally:
        for _, model, eng in configs:
            eng.close()
            model.close()
    print()
    print(f"{'configuration':<14} {'prefill tok/s':>14} {'decode tok/s':>13}")
    base = configs[1][0]
    for phase, _, _ in configs:
        prefill = phase.med(lambda r: len(ids) / r.t_prefill)
        print(f"{phase.name:<14} {prefill:14.1f} {phase.tps:13.1f}")
    on = configs[0][0]
    same = all(a.tokens == b.tokens for a, b in zip(on.reps, base.reps, strict=False))
    print(
        f"on/off: prefill {on.med(lambda r: 1 / r.t_prefill) / base.med(lambda r: 1 / r.t_prefill):.2f}x, "
        f"decode {on.tps / base.tps:.2f}x; same greedy tokens: {same}"
    )
    print(quiet.summary())
    tmp.cleanup()
    return 0


FTYPES = {"q4_0": llama.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama.LLAMA_FTYPE_MOSTLY_Q8_0}


def requantize(src: Path, dst: Path, ftype: int, threads: int) -> Path:
    """``src`` requantized to ``ftype`` in ``dst`` by ``llama_model_quantize`` (``include/llama.h``)."""
    params = llama.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads
    if llama.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {src}")
    print(f"requantized {src.name} -> {dst.name} ({dst.stat().st_size / 2**20:.0f} MiB)")
    return dst


if __name__ == "__main__":
    sys.exit(main())
