"""libllama/build.py without compiling: the backend choice, the build key, the source package's hash check.

The choice is tested with fake programs on ``PATH`` (an ``nvcc`` and an ``nvidia-smi`` that prints a
compute capability) and a fake ``exists`` for the paths it probes (/usr/local/cuda, /dev/nvidia0), so it
never sees this machine's own toolkit; nothing here starts a build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT


def _load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("libllama_build", ROOT / "libllama" / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["libllama_build"] = mod
    spec.loader.exec_module(mod)
    return mod


build = _load_build()


def _tool(folder: Path, name: str, output: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _nothing_else(path: Path) -> bool:
    """``exists`` that sees only what the test made (not this machine's /usr/local/cuda or /dev/nvidia0)."""
    return str(path).startswith(("/tmp", os.environ.get("TMPDIR", "/tmp"))) and path.exists()


@pytest.fixture()
def toolkit(tmp_path: Path) -> Path:
    """A fake CUDA toolkit: bin/nvcc and include/cublas_v2.h."""
    _tool(tmp_path / "cuda" / "bin", "nvcc")
    (tmp_path / "cuda" / "include").mkdir()
    (tmp_path / "cuda" / "include" / "cublas_v2.h").write_text("")
    return tmp_path / "cuda"


def _env(*folders: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.pathsep.join(str(f) for f in folders), "CUDA_HOME": "/nonexistent", **extra}


def test_nvcc_and_gpu_pick_cuda_for_the_gpus_architecture(tmp_path: Path, toolkit: Path) -> None:
    smi = _tool(tmp_path / "drv", "nvidia-smi", "9.0\\n9.0\\n")
    choice = build.choose_backend(_env(toolkit / "bin", smi.parent), exists=_nothing_else)
    assert choice.name == "cuda"
    assert "-DGGML_CUDA=on" in choice.cmake_args
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in choice.cmake_args
    assert f"-DCMAKE_CUDA_COMPILER={toolkit / 'bin' / 'nvcc'}" in choice.cmake_args
    assert "NO_VMM" not in choice.cmake_args  # a GPU is there: the driver's VMM API links
    assert "nvidia-smi" in choice.reason


def test_no_cuda_compiler_or_no_gpu_picks_cpu(tmp_path: Path, toolkit: Path) -> None:
    smi = _tool(tmp_path / "drv", "nvidia-smi", "8.6\\n")
    for env in (_env(smi.parent), _env(toolkit / "bin"), _env(tmp_path / "empty")):
        choice = build.choose_backend(env, exists=_nothing_else)
        assert (choice.name, choice.cmake_args) == ("cpu", "")
        assert choice.reason.startswith("no ")


def test_slotserve_backend_forces_either(tmp_path: Path, toolkit: Path) -> None:
    smi = _tool(tmp_path / "drv", "nvidia-smi", "9.0\\n")
    both = (toolkit / "bin", smi.parent)
    assert build.choose_backend(_env(*both, SLOTSERVE_BACKEND="cpu"), exists=_nothing_else).name == "cpu"
    forced = build.choose_backend(_env(toolkit / "bin", SLOTSERVE_BACKEND="CUDA"), exists=_nothing_else)
    # a compile check on a machine without a GPU: Hopper by default, no driver linked
    assert forced.name == "cuda"
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in forced.cmake_args and "-DGGML_CUDA_NO_VMM=ON" in forced.cmake_args
    archs = build.choose_backend(
        _env(toolkit / "bin", SLOTSERVE_BACKEND="cuda", SLOTSERVE_CUDA_ARCHITECTURES="80;90"), exists=_nothing_else
    )
    assert "-DCMAKE_CUDA_ARCHITECTURES=80;90" in archs.cmake_args
    legacy = build.choose_backend(_env(toolkit / "bin", CMAKE_ARGS="-DGGML_CUDA=on"), exists=_nothing_else)
    assert legacy.name == "cuda"


def test_bad_forcing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(build.BuildError, match="use cpu or cuda"):
        build.choose_backend(_env(tmp_path, SLOTSERVE_BACKEND="rocm"), exists=_nothing_else)
    with pytest.raises(build.BuildError, match="no CUDA compiler"):
        build.choose_backend(_env(tmp_path, SLOTSERVE_BACKEND="cuda"), exists=_nothing_else)


def test_a_toolkit_without_cublas_needs_one_beside_it(tmp_path: Path) -> None:
    nvcc = _tool(tmp_path / "bare" / "bin", "nvcc")
    with pytest.raises(build.BuildError, match="SLOTSERVE_CUBLAS_ROOT"):
        build.choose_backend(_env(nvcc.parent, SLOTSERVE_BACKEND="cuda"), exists=_nothing_else)
    root = tmp_path / "cu13"
    (root / "include").mkdir(parents=True)
    (root / "include" / "cublas_v2.h").write_text("")
    (root / "lib").mkdir()
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (root / "lib" / lib).write_text("")
    env = _env(nvcc.parent, SLOTSERVE_BACKEND="cuda", SLOTSERVE_CUBLAS_ROOT=str(root))
    args = build.choose_backend(env, exists=_nothing_else).cmake_args
    assert f"-DCUDA_cublas_LIBRARY={root / 'lib' / 'libcublas.so.13'}" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{root / 'include'}" in args


def test_key_names_backend_and_architectures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    cpu = build.Backend("cpu", "", "test")
    sm90 = build.Backend("cuda", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90", "test")
    sm80 = build.Backend("cuda", "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=80", "test")
    keys = {build.key(b) for b in (cpu, sm90, sm80)}
    assert len(keys) == 3 and all(len(k) == 12 for k in keys)
    assert build.key(cpu) == build.key(build.Backend("cpu", "", "another reason"))


def test_the_source_package_is_checked_before_patching(tmp_path: Path) -> None:
    archive = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    archive.write_bytes(b"not the pinned sdist")
    with pytest.raises(build.BuildError, match=r"SHA-256 [0-9a-f]+ is not the pinned"):
        build.check_sdist(archive)
    build.check_sdist(archive, hashlib.sha256(b"not the pinned sdist").hexdigest())


def test_upstream_is_named_in_one_place() -> None:
    text = (ROOT / "libllama" / "upstream.toml").read_text()
    assert build.VERSION in text and build.SDIST_SHA256 in text
    assert build.UPSTREAM["llama-cpp"]["commit"]
    assert len(build.SDIST_SHA256) == 64
    # the commit is named nowhere else in libllama/
    commit = build.UPSTREAM["llama-cpp"]["commit"]
    assert [p.name for p in (ROOT / "libllama").iterdir() if commit in p.read_text(errors="replace")] == [
        "upstream.toml"
    ]


def test_every_hunk_of_the_patch_has_its_reason() -> None:
    patch = (ROOT / "libllama" / "hooks.patch").read_text()
    header, _, body = patch.partition("\n--- a/")
    files = {line.split()[1][2:] for line in ("--- a/" + body).splitlines() if line.startswith("--- a/")}
    assert files == {"src/CMakeLists.txt", "src/llama-context.cpp", "src/llama-cparams.h", "src/llama-graph.cpp"}
    for name in files:
        assert name in header, f"hooks.patch's header gives no reason for {name}"
