"""The capture's cost in process: decode step time without attention and with full per-layer attention
in float32 and float16 (and, where the engine has it, aggregated), on one sequence of the default model,
at a few context sizes; optionally beside another checkout of slotserve run with its own interpreter (for example the
last commit before the patched libllama, whose capture read the rows through llama.cpp's eval
callback), in the same run.

    .venv/bin/python benchmarks/bench_capture.py [--contexts 500,2000] [--other CHECKOUT --other-python PY]
        [--model GGUF] [--n-gpu-layers 99]

Each figure is the median of every decode step of ``--reps`` generations of ``--new`` tokens from the
cached context (``Batcher.step`` timed around ``llama_decode`` and the capture; sampling included),
reps of the modes interleaved; each step's rows are let go once read, as the worker does once it wrote
them.  ``--modes`` adds the reduced formats (docs/api.md, "Attention formats"): ``topk`` (8 per layer and
head), ``spans`` (three spans over the context), ``heads`` (two heads of every layer, per layer), ``sink``
(the mass on the first 4 positions beside the aggregated row).  The script only uses what both engines
have (``Engine``, ``EngineSettings``, ``tests.engine.enginekit.Runner``; the reduced formats only when
asked), so it runs unchanged in either checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("none", "full", "full16", "aggregated")
REDUCED = ("topk", "spans", "heads", "sink")


def measure(
    contexts: list[int],
    new: int,
    reps: int,
    threads: int,
    modes: tuple[str, ...] = MODES,
    model_path: Path | None = None,
    n_gpu_layers: int = 0,
) -> dict[str, dict[str, float]]:
    """``{context: {mode: median decode step ms}}`` in this process's checkout (``model_path``: default the
    default model; ``n_gpu_layers`` offloaded to a GPU)."""
    import llama_cpp  # noqa: F401 - llama.cpp before numpy

    from contract.options import CaptureOptions
    from contract.settings import EngineSettings
    from engine.engine import Engine
    from engine.model import Model, default_model_path
    from tests.engine.enginekit import Runner

    model = Model(model_path or default_model_path(), n_gpu_layers=n_gpu_layers)
    settings = EngineSettings(
        n_ctx=max(contexts) + new + 256, n_slots=1, n_spare=1, n_threads=threads, n_gpu_layers=n_gpu_layers
    )
    eng = Engine(model, settings)

    def options(mode: str, n: int) -> CaptureOptions:
        q = n // 4  # (the reduced formats' options exist only in checkouts that have them)
        return {
            "none": lambda: CaptureOptions(),
            "full": lambda: CaptureOptions(attention=True),
            "full16": lambda: CaptureOptions(attention=True, dtype="float16"),
            "aggregated": lambda: CaptureOptions(attention=True, format="aggregated"),
            "topk": lambda: CaptureOptions(attention=True, format="topk", top_k=8),
            "spans": lambda: CaptureOptions(attention=True, format="spans", spans=[(0, q), (q, 2 * q), (2 * q, n)]),
            "heads": lambda: CaptureOptions(attention=True, heads=[0, 4]),
            "sink": lambda: CaptureOptions(attention=True, format="aggregated", sink=4),
        }[mode]()

    words = ("the slot keeps its context and the model pays attention to every word of it " * 1600).split()
    out: dict[str, dict[str, float]] = {}
    for n in contexts:
        ids = model.tokenize(" ".join(words), True, False)[:n]
        eng.erase(0)
        Runner(eng).generate(0, ids, max_new_tokens=1, ignore_eos=True)
        steps: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(reps + 1):
            for mode in modes:
                runner = Runner(eng)
                runner.submit(0, ids, capture=options(mode, n), max_new_tokens=new, ignore_eos=True)
                times = []
                while runner.batcher.has_work():
                    t0 = time.perf_counter()
                    runner.batcher.step()
                    times.append(time.perf_counter() - t0)
                    for res in runner.results.values():  # read: let go, as the worker once it wrote them
                        res.attention.clear()
                if r:
                    steps[mode] += times[2:]  # past the re-decoded last prompt token and the first step
        out[str(n)] = {m: round(statistics.median(v) * 1000, 3) for m, v in steps.items() if v}
    eng.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="500,2000")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES + REDUCED)}")
    ap.add_argument("--other", type=Path, default=None, help="another slotserve checkout to measure alike")
    ap.add_argument("--other-python", type=Path, default=None, help="its interpreter (its own venv)")
    ap.add_argument("--json", action="store_true", help="print this checkout's figures as JSON only")
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers offloaded to a GPU")
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    modes = tuple(a.modes.split(","))
    if "none" not in modes or not set(modes) <= set(MODES + REDUCED):
        ap.error(f"--modes: 'none' and any of {', '.join(MODES[1:] + REDUCED)}")
    if a.json:
        print(json.dumps(measure(contexts, a.new, a.reps, a.threads, modes, a.model, a.n_gpu_layers)))
        return 0
    here = Path(__file__).resolve().parent.parent
    runs = [("this checkout", here, Path(sys.executable))]
    if a.other:
        runs.append((f"{a.other}", a.other.resolve(), a.other_python or Path(sys.executable)))
    results = {}
    for name, root, py in runs:
        argv = [str(py), str(here / "benchmarks" / "bench_capture.py"), "--json", "--contexts", a.contexts, "--new",
                str(a.new), "--reps", str(a.reps), "--threads", str(a.threads), "--modes", a.modes]  # fmt: skip
        if a.model is not None:  # (only where asked: an older checkout may not know these options)
            argv += ["--model", str(a.model.resolve())]
        if a.n_gpu_layers:
            argv += ["--n-gpu-layers", str(a.n_gpu_layers)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
        done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"machine: {os.cpu_count()} cores; {a.threads} threads; {a.new} new tokens x {a.reps} reps; "
        f"{a.n_gpu_layers} layers offloaded"
    )
    print(
        "| checkout | context | decode ms/token: "
        + " / ".join(modes)
        + " | "
        + " | ".join(f"none / {m}" for m in modes[1:])
        + " |"
    )
    print("|---|---|---|" + "---|" * (len(modes) - 1))
    for name, res in results.items():
        for n, ms in res.items():
            cells = " / ".join(f"{ms[m]:.2f}" if m in ms else "-" for m in modes)
            ratios = " | ".join(f"{ms['none'] / ms[m]:.3f}" if m in ms else "-" for m in modes[1:])
            print(f"| {name} | {n} | {cells} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
