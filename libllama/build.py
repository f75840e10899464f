"""Build llama-cpp-python 0.3.36 from its vendored llama.cpp with slotserve's patch applied; print the wheel.

Usage: ``python libllama/build.py [--source | --cmake-args]`` (``scripts/setup`` runs it).  Prints the path of a
wheel of llama-cpp-python whose libllama carries this folder's patch (``--source``: the patched
source tree instead, e.g. to build llama-server from the same sources for a benchmark).

The backend is chosen by :func:`choose_backend` (CUDA where a CUDA compiler and an NVIDIA GPU are
both present, else CPU; ``SLOTSERVE_BACKEND=cpu|cuda`` forces one, docs/gpu.md) and said on stderr.
The wheel is kept in ``$SLOTSERVE_CACHE`` (default ``~/.cache/slotserve``) under a key of the
patch's files, the backend, its CMake arguments (the CUDA architectures among them) and
``$CMAKE_ARGS``, so a second set-up, or a second checkout, does not compile again.  Its version is
``0.3.36+slotserve.<key>``: it satisfies slotserve's pin ``llama-cpp-python==0.3.36`` (PEP 440
ignores a local label the pin does not name) and tells the builds apart.

The patch is applied the way Ollama applies its llama.cpp patches: to the pinned upstream named
in ``upstream.toml`` (llama-cpp-python's sdist from PyPI, whose SHA-256 is checked before anything
is extracted: a mismatch stops the build), new files copied in, and each ``patches/*.patch``
applied in order with ``patch``; a patch that does not apply stops the build (drift is a hard
failure, never a silent skip), and applying to a tree that has it already changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
UPSTREAM = tomllib.loads((HERE / "upstream.toml").read_text())
VERSION: str = UPSTREAM["llama-cpp-python"]["version"]
SDIST_SHA256: str = UPSTREAM["llama-cpp-python"]["sha256"]
NEW_FILES = {
    "llama-attn.h": "include",
    "llama-attn-impl.h": "src",
    "llama-attn-hooks.h": "src",
    "llama-attn-graph.cpp": "src",
    "llama-attn-capture.cpp": "src",
    "llama-attn-kv.cpp": "src",
    "llama-attn-state.cpp": "src",
    "llama-attn-file.cpp": "src",
}
# what slotserve does not use: the multimodal library, tests, examples and tools (llama-server is
# built on its own when a benchmark needs it: --source)
BASE_CMAKE_ARGS = "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
CUDA_HOME = Path("/usr/local/cuda")


class BuildError(RuntimeError):
    """The source package's hash, the patch or the build failed."""


@dataclass(frozen=True)
class Backend:
    """The backend a build compiles: ``name`` is ``"cpu"`` or ``"cuda"``; ``cmake_args`` are llama.cpp's
    CMake options for it (``-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=...``); ``reason`` says why it was picked."""

    name: str
    cmake_args: str
    reason: str


def _nvcc(env: Mapping[str, str], which: Callable[..., str | None], exists: Callable[[Path], bool]) -> str | None:
    found = which("nvcc", path=env.get("PATH"))
    if found:
        return os.path.realpath(found)  # CMake finds the toolkit beside the real nvcc, not a link to it
    cuda = Path(env.get("CUDA_HOME", str(CUDA_HOME))) / "bin" / "nvcc"
    return str(cuda) if exists(cuda) else None


def _gpu(env: Mapping[str, str], which: Callable[..., str | None], exists: Callable[[Path], bool]) -> str | None:
    smi = which("nvidia-smi", path=env.get("PATH"))
    if smi:
        return smi
    return "/dev/nvidia0" if exists(Path("/dev/nvidia0")) else None


def _cuda_archs(env: Mapping[str, str], smi: str | None) -> str:
    """``SLOTSERVE_CUDA_ARCHITECTURES``, else the GPUs' compute capabilities from nvidia-smi (``9.0`` -> ``90``),
    else ``native`` (CMake asks the local GPU)."""
    if env.get("SLOTSERVE_CUDA_ARCHITECTURES"):
        return env["SLOTSERVE_CUDA_ARCHITECTURES"]
    if smi and not smi.startswith("/dev/"):
        try:
            out = subprocess.run(
                [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                env=dict(env),
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        caps = sorted({c.strip().replace(".", "") for c in out.splitlines() if re.fullmatch(r"\d+\.\d+", c.strip())})
        if caps:
            return ";".join(caps)
    return "native"


def _cublas_args(env: Mapping[str, str], nvcc: str, exists: Callable[[Path], bool]) -> str:
    """CMake arguments that point ggml-cuda at cuBLAS when the toolkit beside ``nvcc`` lacks it (a toolkit
    installed without its math libraries): ``$SLOTSERVE_CUBLAS_ROOT`` is a folder with ``include/cublas_v2.h``
    and ``lib/libcublas.so.*``, e.g. ``nvidia/cu13`` of PyPI's ``nvidia-cublas`` wheel.  Raises
    :class:`BuildError` when neither has it."""
    if exists(Path(nvcc).parent.parent / "include" / "cublas_v2.h"):
        return ""
    root = env.get("SLOTSERVE_CUBLAS_ROOT")
    if not root or not exists(Path(root) / "include" / "cublas_v2.h"):
        raise BuildError(
            f"the CUDA toolkit of {nvcc} has no cuBLAS: install it, or set SLOTSERVE_CUBLAS_ROOT to a folder "
            "with include/cublas_v2.h and lib/libcublas.so.* (nvidia/cu13 of PyPI's nvidia-cublas wheel)"
        )
    libs = {n: sorted(Path(root, "lib").glob(f"lib{n}.so*")) for n in ("cublas", "cublasLt")}
    if not all(libs.values()):
        raise BuildError(f"SLOTSERVE_CUBLAS_ROOT={root}: no lib/libcublas.so* and lib/libcublasLt.so*")
    inc = Path(root) / "include"
    return (
        f" -DCUDA_cublas_LIBRARY={libs['cublas'][0]} -DCUDA_cublasLt_LIBRARY={libs['cublasLt'][0]}"
        f" -DCMAKE_CUDA_FLAGS=-I{inc} -DCMAKE_CXX_FLAGS=-I{inc}"
    )


def choose_backend(
    env: Mapping[str, str] | None = None,
    which: Callable[..., str | None] = shutil.which,
    exists: Callable[[Path], bool] = Path.exists,
) -> Backend:
    """Pick the backend to build: CUDA when a CUDA compiler (``nvcc`` on ``PATH`` or under ``$CUDA_HOME``,
    default /usr/local/cuda) and an NVIDIA GPU (``nvidia-smi`` on ``PATH`` or /dev/nvidia0) are both present,
    else CPU.  ``SLOTSERVE_BACKEND=cpu|cuda`` forces one (a forced CUDA build without a GPU is a compile
    check: ``-DGGML_CUDA_NO_VMM=ON``, so nothing links the driver; the architectures default to 90 there).
    A ``-DGGML_CUDA=on`` already in ``$CMAKE_ARGS`` counts as forcing CUDA.

    Raises :class:`BuildError` for another ``SLOTSERVE_BACKEND`` value, or a forced CUDA without a compiler.
    """
    env = os.environ if env is None else env
    forced = env.get("SLOTSERVE_BACKEND", "").strip().lower()
    if not forced and re.search(r"-DGGML_CUDA=(on|1|true|yes)\b", env.get("CMAKE_ARGS", ""), re.IGNORECASE):
        forced = "cuda"
    if forced not in ("", "cpu", "cuda"):
        raise BuildError(f"SLOTSERVE_BACKEND={forced!r}: use cpu or cuda")
    if forced == "cpu":
        return Backend("cpu", "", "SLOTSERVE_BACKEND=cpu")
    nvcc, gpu = _nvcc(env, which, exists), _gpu(env, which, exists)
    if forced == "cuda" and not nvcc:
        raise BuildError("SLOTSERVE_BACKEND=cuda but no CUDA compiler: put nvcc on PATH or set CUDA_HOME")
    if not forced and not (nvcc and gpu):
        missing = "CUDA compiler (nvcc)" if not nvcc else "NVIDIA GPU (nvidia-smi, /dev/nvidia0)"
        return Backend("cpu", "", f"no {missing} found")
    if not nvcc:  # not forced: both found above; forced: refused above
        raise BuildError("no CUDA compiler")
    archs = _cuda_archs(env, gpu) if gpu or env.get("SLOTSERVE_CUDA_ARCHITECTURES") else "90"
    args = f"-DGGML_CUDA=on -DCMAKE_CUDA_COMPILER={nvcc} -DCMAKE_CUDA_ARCHITECTURES={archs}"
    args += _cublas_args(env, nvcc, exists)
    if not gpu:
        args += " -DGGML_CUDA_NO_VMM=ON"
    why = "SLOTSERVE_BACKEND=cuda" if forced else f"CUDA compiler {nvcc} and NVIDIA GPU {gpu}"
    return Backend("cuda", args, f"{why}; architectures {archs}" + ("" if gpu else ", no GPU: NO_VMM"))


def cmake_args(backend: Backend, env: Mapping[str, str] | None = None) -> str:
    """The CMake arguments of a build: the base ones, the backend's, then ``$CMAKE_ARGS`` (which win)."""
    env = os.environ if env is None else env
    return " ".join(a for a in (BASE_CMAKE_ARGS, backend.cmake_args, env.get("CMAKE_ARGS", "").strip()) if a)


def key(backend: Backend | None = None) -> str:
    """12 hex digits naming this patch, the pinned upstream and the build configuration (backend, CMake arguments)."""
    backend = backend or choose_backend()
    h = hashlib.sha256()
    for name in [*sorted(NEW_FILES), "hooks.patch", "upstream.toml"]:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    for part in (VERSION, backend.name, cmake_args(backend)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


def cache_dir() -> Path:
    return Path(os.environ.get("SLOTSERVE_CACHE", Path.home() / ".cache" / "slotserve"))


def run(cmd: list[str], **kw: object) -> None:
    try:
        subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"{' '.join(cmd[:4])} ... failed with exit status {exc.returncode}") from exc


def check_sdist(archive: Path, expected: str = SDIST_SHA256) -> None:
    """Raise :class:`BuildError` unless ``archive``'s SHA-256 is ``expected`` (upstream.toml's)."""
    h = hashlib.sha256()
    with archive.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != expected:
        raise BuildError(
            f"{archive.name}: SHA-256 {h.hexdigest()} is not the pinned {expected} (libllama/upstream.toml); "
            "refusing to patch other sources"
        )


def sdist(tmp: Path) -> Path:
    """llama-cpp-python's sdist: ``$SLOTSERVE_SDIST`` (a local copy, for an offline machine) or the package
    index's (pip's cache keeps it), checked against upstream.toml's SHA-256 (:func:`check_sdist`)."""
    local = os.environ.get("SLOTSERVE_SDIST")
    if local:
        found = [Path(local)]
    else:
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={VERSION}",
                "-d",
                str(tmp),
            ],
            stdout=subprocess.DEVNULL,
        )
        found = sorted(tmp.glob("llama_cpp_python-*.tar.gz"))
    if not found or not found[0].is_file():
        raise BuildError(f"no sdist of llama-cpp-python {VERSION} ({local or 'pip download found none'})")
    check_sdist(found[0])
    return found[0]


def apply_patch(src: Path, k: str) -> None:
    """Apply this folder's patch to the extracted sdist ``src`` (idempotent; drift raises :class:`BuildError`)."""
    llama = src / "vendor" / "llama.cpp"
    for name, where in NEW_FILES.items():
        shutil.copyfile(HERE / name, llama / where / name)
    patch = (HERE / "hooks.patch").read_bytes()
    applied = subprocess.run(
        ["patch", "-p1", "-R", "--dry-run", "-s", "-f", "-d", str(llama)], input=patch, capture_output=True
    )
    if applied.returncode != 0:
        done = subprocess.run(
            ["patch", "-p1", "--forward", "-s", "-f", "-d", str(llama)], input=patch, capture_output=True
        )
        if done.returncode != 0:
            raise BuildError(
                "libllama/hooks.patch no longer applies to llama-cpp-python "
                f"{VERSION}'s llama.cpp (drift):\n{done.stdout.decode(errors='replace')}"
            )
    init = src / "llama_cpp" / "__init__.py"
    text = re.sub(r'__version__ = "[^"]*"', f'__version__ = "{VERSION}+slotserve.{k}"', init.read_text())
    init.write_text(text)


def source(backend: Backend | None = None) -> Path:
    """The patched source tree (extracted once per key)."""
    k = key(backend)
    dest = cache_dir() / "src" / f"llama_cpp_python-{VERSION}-{k}"
    if (dest / ".complete").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        archive = sdist(Path(tmp))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="tar")
        tree = Path(tmp) / f"llama_cpp_python-{VERSION}"
        apply_patch(tree, k)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tree), dest)
    (dest / ".complete").write_text(k)
    return dest


def wheel() -> Path:
    """The wheel of this key, built if absent (about 5 minutes on 2 cores for CPU; CUDA: docs/gpu.md)."""
    backend = choose_backend()
    k = key(backend)
    print(f"libllama: {backend.name} backend ({backend.reason}); key {k}", file=sys.stderr)
    out = cache_dir() / "wheels" / k
    found = sorted(out.glob("llama_cpp_python-*.whl"))
    if found:
        return found[0]
    src = source(backend)
    env = {**os.environ, "CMAKE_ARGS": cmake_args(backend)}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building llama-cpp-python {VERSION} with slotserve's libllama patch ({k})...", file=sys.stderr)
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, str(src)], env=env)
        built = sorted(Path(tmp).glob("llama_cpp_python-*.whl"))
        if not built:
            raise BuildError("pip wheel produced no wheel")
        out.mkdir(parents=True, exist_ok=True)
        shutil.move(str(built[0]), out / built[0].name)
    return out / built[0].name


def main() -> int:
    """``build.py`` prints the wheel; ``--source`` the patched tree; ``--cmake-args`` the CMake arguments of this
    machine's backend (for a build of the patched tree by hand, with llama-server: benchmarks/gpu/check.sh)."""
    try:
        if "--cmake-args" in sys.argv[1:]:
            print(cmake_args(choose_backend()))
        else:
            print(source() if "--source" in sys.argv[1:] else wheel())
    except BuildError as exc:
        print(f"libllama: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
