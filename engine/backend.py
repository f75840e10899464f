"""What llama.cpp runs on here: backend devices, CPU extra buffer types, and the safe choice.

llama.cpp's CPU backend can keep weights in *extra buffer types* (``CPU_REPACK``:
weights repacked for wider SIMD; ``AMX``: Intel AMX tiles), chosen per model load by
``llama_model_params.use_extra_bufts`` (``include/llama.h``; llama-server's
``--no-repack`` turns it off).  Which extra buffer types exist depends on the CPU and
on how ggml was built; ``ggml_backend_dev_get_extra_bufts`` (``ggml/src/ggml-cpu/ggml-cpu.cpp``)
lists them.  The functions here read that list and the devices through the ggml
library llama.cpp itself uses (:data:`engine.native.lib`: ggml's symbols through libllama), without loading
a model, and decide whether the engine keeps repacking on and what ``--flash-attn auto`` means here
(see docs/hardware.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from contract.kv_types import FLOAT_KV_TYPES
from contract.settings import CaptureGraph
from engine.native import lib as libggml

# enum ggml_backend_dev_type (ggml/include/ggml-backend.h)
DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}

# Extra buffer types whose use crashed llama.cpp 0.3.36's CPU backend on real hosts
# (docs/hardware.md): the AMX buffer type, offered on CPUs with amx_int8.  "auto" keeps
# the other extra buffer types (CPU_REPACK) on, since they are safe and fast elsewhere.
UNSAFE_EXTRA_BUFTS = frozenset({"AMX"})

_sig = {
    "ggml_backend_dev_count": ([], ctypes.c_size_t),
    "ggml_backend_dev_get": ([ctypes.c_size_t], ctypes.c_void_p),
    "ggml_backend_dev_name": ([ctypes.c_void_p], ctypes.c_char_p),
    "ggml_backend_dev_description": ([ctypes.c_void_p], ctypes.c_char_p),
    "ggml_backend_dev_type": ([ctypes.c_void_p], ctypes.c_int),
    "ggml_backend_dev_backend_reg": ([ctypes.c_void_p], ctypes.c_void_p),
    "ggml_backend_dev_by_type": ([ctypes.c_int], ctypes.c_void_p),
    "ggml_backend_reg_get_proc_address": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
    "ggml_backend_buft_name": ([ctypes.c_void_p], ctypes.c_char_p),
    "ggml_backend_dev_by_name": ([ctypes.c_char_p], ctypes.c_void_p),
}
for _name, (_args, _res) in _sig.items():
    _fn = getattr(libggml, _name)
    _fn.argtypes, _fn.restype = _args, _res

_EXTRA_BUFTS_FN = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


@dataclass(frozen=True)
class Device:
    """One ggml backend device: ``name`` (``CPU``, ``CUDA0``), ``description``, ``type`` (``CPU``/``GPU``/...)."""

    name: str
    description: str
    type: str


def devices() -> list[Device]:
    """The backend devices llama.cpp registered (``ggml_backend_dev_get``), in registry order.

    Call after ``llama_backend_init`` (:func:`engine.model.init_backend`).
    """
    out = []
    for i in range(libggml.ggml_backend_dev_count()):
        dev = libggml.ggml_backend_dev_get(i)
        out.append(
            Device(
                name=(libggml.ggml_backend_dev_name(dev) or b"").decode(),
                description=(libggml.ggml_backend_dev_description(dev) or b"").decode(),
                type=DEVICE_TYPES.get(libggml.ggml_backend_dev_type(dev), "?"),
            )
        )
    return out


class UnknownDeviceError(ValueError):
    """A ``--device`` name that no registered ggml backend device has."""


@dataclass(frozen=True)
class Placement:
    """Where a model's offloaded layers go, as llama-server's flags say (``llama_model_params``,
    ``include/llama.h``): ``devices`` by ggml name (empty: every GPU; ``("none",)``: none), ``split_mode``
    (``enum llama_split_mode``), ``main_gpu`` (index among the devices used) and ``tensor_split``
    (proportions per device, empty: by free memory)."""

    devices: tuple[str, ...] = ()
    split_mode: int = 1
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()


def device_handles(names: tuple[str, ...]) -> list[int]:
    """``ggml_backend_dev_t`` handles of the named devices (``ggml_backend_dev_by_name``, case-insensitive);
    ``("none",)`` gives none.  Raises :class:`UnknownDeviceError` naming the devices that exist.

    Call after ``llama_backend_init`` (:func:`engine.model.init_backend`)."""
    if tuple(n.lower() for n in names) == ("none",):
        return []
    out = []
    for name in names:
        dev = libggml.ggml_backend_dev_by_name(name.encode())
        if not dev:
            known = ", ".join(d.name for d in devices())
            raise UnknownDeviceError(f"--device {name}: no such device (this machine has: {known})")
        out.append(dev)
    return out


def cpu_extra_bufts() -> list[str]:
    """Names of the CPU backend's extra buffer types on this host (e.g. ``["AMX", "CPU_REPACK"]``).

    The same list llama.cpp's ``make_cpu_buft_list`` (``src/llama-model.cpp``) walks when
    ``use_extra_bufts`` is true; empty when the CPU backend offers none.
    """
    cpu = libggml.ggml_backend_dev_by_type(0)
    if not cpu:
        return []
    reg = libggml.ggml_backend_dev_backend_reg(cpu)
    addr = libggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not addr:
        return []
    bufts = _EXTRA_BUFTS_FN(addr)(cpu)
    names = []
    i = 0
    while bufts and bufts[i]:
        names.append((libggml.ggml_backend_buft_name(bufts[i]) or b"").decode())
        i += 1
    return names


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class RepackChoice:
    """Whether to load weights into the CPU's extra buffer types, and why."""

    use_extra_bufts: bool
    reason: str


def choose_repack(requested: bool | None, extra_bufts: list[str]) -> RepackChoice:
    """Decide ``use_extra_bufts``: ``requested`` True/False wins; ``None`` (auto) avoids unsafe ones.

    Auto turns extra buffer types off only where llama.cpp offers one known to crash
    (:data:`UNSAFE_EXTRA_BUFTS`), keeping ``CPU_REPACK``'s faster kernels elsewhere.
    """
    if requested is not None:
        return RepackChoice(requested, "requested (--repack)" if requested else "requested (--no-repack)")
    unsafe = sorted(UNSAFE_EXTRA_BUFTS.intersection(extra_bufts))
    if unsafe:
        return RepackChoice(False, f"auto: off, this CPU offers {', '.join(unsafe)} (crashes in llama.cpp 0.3.36)")
    if not extra_bufts:
        return RepackChoice(False, "auto: the CPU backend offers no extra buffer types")
    return RepackChoice(True, f"auto: on ({', '.join(extra_bufts)})")


def stable_capture_graph(n_gpu_layers: int, setting: CaptureGraph = "auto") -> bool:
    """Whether the capture keeps one graph shape for decodes with and without attention
    (``llama_attn_set_stable``, libllama/llama-attn.h; ``--capture-graph``: ``stable``, ``lean`` or ``auto``):
    with ``auto``, where layers run on a GPU, so the CUDA backend keeps replaying its CUDA graph when clients
    switch attention on and off; not on a CPU, where there is no graph to keep and the capture's nodes would
    cost every decode some work (docs/gpu.md)."""
    if setting != "auto":
        return setting == "stable"
    return n_gpu_layers > 0 and any(d.type in ("GPU", "IGPU") for d in devices())


@dataclass(frozen=True)
class FlashAttnChoice:
    """The flash attention setting to create the context with (``auto``: llama.cpp decides, as
    ``LLAMA_FLASH_ATTN_TYPE_AUTO`` in ``include/llama.h``; ``on``; ``off``), and why."""

    setting: str
    reason: str


def choose_flash_attn(requested: str, n_gpu_layers: int, type_v: str) -> FlashAttnChoice:
    """Resolve ``--flash-attn``: ``on``/``off`` win; ``auto`` is llama.cpp's own choice where layers run on a
    GPU, and off on a CPU-only engine unless a quantized V cache needs flash attention.

    Why off on a CPU: without flash attention the attention rows are gathered from the softmax the model
    computes anyway, while with it they are recomputed (a second Q·Kᵀ per layer), and llama.cpp's CPU
    decode is no slower without it (docs/benchmarks.md, "Issue 25": at 4,000 tokens of context aggregated
    attention 0.99 of llama-server's speed with flash attention off, 0.71 with it on).
    """
    if requested != "auto":
        return FlashAttnChoice(requested, f"requested (--flash-attn {requested})")
    if type_v not in FLOAT_KV_TYPES:
        return FlashAttnChoice("on", f"auto: on (a {type_v} V cache needs flash attention)")
    if n_gpu_layers > 0 and any(d.type in ("GPU", "IGPU") for d in devices()):
        return FlashAttnChoice("auto", "auto: llama.cpp's choice (layers on a GPU)")
    return FlashAttnChoice("off", "auto: off on a CPU (rows from the softmax the model computes; docs/hardware.md)")
