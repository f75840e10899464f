"""llama-server's GPU placement flags reach llama_model_params (engine/model.py, engine/backend.py).

On this GPU-less machine: ``--device none`` loads every layer on the CPU, an unknown device or too many
``--tensor-split`` parts is refused before llama.cpp loads anything, with a message naming what exists;
a worker started with a bad placement says why and exits (no HTTP port opens: tests/orchestrator cover
start-up failures).  Which GPU gets which layers needs GPUs: docs/gpu.md's device check.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp as llama
import pytest

from engine import backend
from engine.model import Model, ModelLoadError


def test_device_none_loads_on_the_cpu(model_path: Path) -> None:
    m = Model(model_path, n_gpu_layers=99, placement=backend.Placement(devices=("none",)))
    try:
        assert m.n_layer == 30 and m.describe()
    finally:
        m.close()


def test_an_unknown_device_is_refused_naming_the_devices(model_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"--device CUDA7: no such device \(this machine has: CPU"):
        Model(model_path, n_gpu_layers=99, placement=backend.Placement(devices=("CUDA7",)))


def test_more_tensor_split_parts_than_llama_cpp_takes_are_refused(model_path: Path) -> None:
    parts = (1.0,) * (llama.llama_max_devices() + 1)
    with pytest.raises(ModelLoadError, match="--tensor-split has"):
        Model(model_path, placement=backend.Placement(tensor_split=parts))


def test_device_names_resolve_as_ggml_names_them() -> None:
    assert backend.device_handles(("none",)) == [] and backend.device_handles(("NONE",)) == []
    (cpu,) = backend.device_handles(("cpu",))  # ggml_backend_dev_by_name ignores case
    assert cpu
    with pytest.raises(backend.UnknownDeviceError):
        backend.device_handles(("CPU", "Vulkan3"))


def test_the_capture_keeps_lean_graphs_without_a_gpu() -> None:
    assert backend.stable_capture_graph(0) is False
    assert backend.stable_capture_graph(99) is False  # no GPU device here
    assert backend.stable_capture_graph(99, "auto") is False


def test_capture_graph_setting_overrides_the_device_choice() -> None:
    """``--capture-graph stable`` / ``lean`` decide whatever the devices (a GPU user who never asks for attention
    may prefer decodes without the capture's nodes)."""
    assert backend.stable_capture_graph(0, "stable") is True
    assert backend.stable_capture_graph(99, "lean") is False


def test_a_model_loaded_without_a_repack_choice_takes_the_workers_auto_choice(model_path: Path) -> None:
    """``Model(path)`` (the tests', the benchmarks') chooses repacking as the worker does: never onto AMX, whose
    kernels fault on the first multi-token decode (docs/hardware.md); on this machine a model loaded with
    llama.cpp's own default crashed the whole test run where the CPU offers AMX."""
    extra = backend.cpu_extra_bufts()
    m = Model(model_path)
    try:
        assert m.repack == backend.choose_repack(None, extra)
        assert m.repack.use_extra_bufts is (bool(extra) and "AMX" not in extra)
    finally:
        m.close()
