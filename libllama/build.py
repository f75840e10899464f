"""Build llama-cpp-python 0.3.36 from its vendored llama.cpp with slotserve's patch applied; print the wheel.

Usage: ``python libllama/build.py [--source]`` (``scripts/setup`` runs it).  Prints the path of a
wheel of llama-cpp-python whose libllama carries this folder's patch (``--source``: the patched
source tree instead, e.g. to build llama-server from the same sources for a benchmark).

The wheel is kept in ``$SLOTSERVE_CACHE`` (default ``~/.cache/slotserve``) under a key of the
patch's files, this script and ``$CMAKE_ARGS`` (``-DGGML_CUDA=on`` for CUDA: docs/gpu.md), so a
second set-up, or a second checkout, does not compile again.  Its version is
``0.3.36+slotserve.<key>``: it satisfies slotserve's pin ``llama-cpp-python==0.3.36`` (PEP 440
ignores a local label the pin does not name) and tells the builds apart.

The patch is applied the way Ollama applies its llama.cpp patches: to the pinned upstream
(llama-cpp-python's sdist from PyPI, the same bytes every time), new files copied in, and
``hooks.patch`` applied with ``patch``; a patch that does not apply stops the build
(drift is a hard failure, never a silent skip), and applying to a tree that has it already
changes nothing.
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
from pathlib import Path

VERSION = "0.3.36"
HERE = Path(__file__).resolve().parent
NEW_FILES = {"llama-attn.h": "include", "llama-attn.cpp": "src", "llama-attn-hooks.h": "src"}
# what slotserve does not use: the multimodal library, tests, examples and tools (llama-server is
# built on its own when a benchmark needs it: --source)
BASE_CMAKE_ARGS = "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"


class BuildError(RuntimeError):
    """The patch did not apply or the build failed."""


def key() -> str:
    """12 hex digits naming this patch and build configuration."""
    h = hashlib.sha256()
    for name in [*sorted(NEW_FILES), "hooks.patch"]:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    for part in (VERSION, BASE_CMAKE_ARGS, os.environ.get("CMAKE_ARGS", "")):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


def cache_dir() -> Path:
    return Path(os.environ.get("SLOTSERVE_CACHE", Path.home() / ".cache" / "slotserve"))


def run(cmd: list[str], **kw: object) -> None:
    try:
        subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"{' '.join(cmd[:4])} ... failed with exit status {exc.returncode}") from exc


def sdist(tmp: Path) -> Path:
    """llama-cpp-python's sdist from the package index (pip's cache keeps it)."""
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
    if not found:
        raise BuildError(f"pip did not download llama-cpp-python {VERSION}'s sdist")
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


def source() -> Path:
    """The patched source tree (extracted once per key)."""
    k = key()
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
    """The wheel of this key, built if absent (about 5 minutes on 2 cores; more with CUDA)."""
    k = key()
    out = cache_dir() / "wheels" / k
    found = sorted(out.glob("llama_cpp_python-*.whl"))
    if found:
        return found[0]
    src = source()
    env = {**os.environ, "CMAKE_ARGS": f"{BASE_CMAKE_ARGS} {os.environ.get('CMAKE_ARGS', '')}".strip()}
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
    try:
        print(source() if "--source" in sys.argv[1:] else wheel())
    except BuildError as exc:
        print(f"libllama: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
