"""llama.cpp's libraries load before numpy's in every engine entry point.

On a CUDA build of the pinned llama.cpp, loading numpy (its OpenBLAS and runtime
libraries) before llama_cpp made ``llama_model_load_from_file`` crash (docs/hardware.md);
llama_cpp first did not.  Each entry is imported in a fresh interpreter and the order is read
from ``sys.modules`` (insertion order): ``llama_cpp.llama_cpp`` (the module that opens
libllama and, through it, libggml) must come before any ``numpy`` module.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("entry", ["engine.worker", "engine.native", "engine.engine", "engine.model", "engine.backend"])
def test_llama_cpp_loads_before_numpy(entry: str) -> None:
    code = (
        f"import sys, {entry}; m = list(sys.modules); "
        "print(m.index('llama_cpp.llama_cpp'), min(i for i, k in enumerate(m) if k.split('.')[0] == 'numpy'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    llama_at, numpy_at = map(int, out.stdout.split())
    assert llama_at < numpy_at, f"{entry}: numpy was imported before llama_cpp"


def test_ggml_symbols_come_from_llamas_own_copy() -> None:
    """ggml functions are resolved through libllama's handle, not a second libggml opened by path."""
    import llama_cpp

    from engine.native import lib as libggml

    assert libggml is llama_cpp.llama_cpp._lib
