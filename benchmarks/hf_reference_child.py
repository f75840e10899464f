"""``engine_rows.reference``'s transformers side, in its own process: torch and llama.cpp in one process
abort or crash on the GPU machine, so this never imports ``llama_cpp`` or ``engine``.

``python benchmarks/hf_reference_child.py IN.npz OUT.npz`` with the repository root on ``PYTHONPATH``.
``IN.npz`` holds ``model`` (the GGUF path), ``ids`` (prompt + generated tokens), ``n_prompt``, ``n_runs``
and, for run ``i``, ``rows_{i}_{k}`` (generated token k's attention); ``OUT.npz`` gets ``corr[i]`` and
``mad[i]`` from :func:`tests.engine.hf_reference.generated_rows_vs_reference`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def main(src: str, dst: str) -> None:
    from tests.engine.hf_reference import generated_rows_vs_reference, load_reference, reference_forward

    with np.load(src) as f:
        data = {k: f[k] for k in f.files}
    n_prompt = int(data["n_prompt"])
    att, _ = reference_forward(load_reference(Path(str(data["model"]))), [int(t) for t in data["ids"]])
    corr, mad = [], []
    for i in range(int(data["n_runs"])):
        rows: list[np.ndarray] = []
        while f"rows_{i}_{len(rows)}" in data:
            rows.append(data[f"rows_{i}_{len(rows)}"])
        c, m = generated_rows_vs_reference(rows, att, n_prompt)
        corr.append(c)
        mad.append(m)
    np.savez(dst, corr=np.array(corr), mad=np.array(mad))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
