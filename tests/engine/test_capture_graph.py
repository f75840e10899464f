"""The capture's graph on a device: one graph shape with and without rows (CUDA graphs stay), rows copied
into the device's host buffer type, and what /health says about CUDA graphs (libllama/llama-attn.h).

Shown here on the CPU backend, where llama.cpp's own graph reuse (``llm_graph_result::can_reuse``, counted
in ``llama_perf_context``'s ``n_reused``) is the observable: a graph llama.cpp reuses is the graph a CUDA
backend replays as its CUDA graph (ggml-cuda keys it by the graph's first node and re-captures it when a
node's shape or source changes).  Both flash attention settings (the ``engine`` fixture's two parameters).
"""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp as llama
import numpy as np
import pytest

from contract.options import CaptureOptions
from contract.settings import EngineSettings
from engine import native
from engine.batch import BatchEntry
from engine.engine import Engine
from engine.model_info import cuda_graphs, runtime_info
from tests.conftest import CHAT

ALTERNATING = [True, False] * 5  # a client switching attention on and off every token


@pytest.fixture()
def prompt(model) -> list[int]:  # type: ignore[no-untyped-def]
    return model.tokenize(CHAT.format("Count from one to twenty."), False, True)


@pytest.fixture()
def stable(engine: Engine) -> Iterator[None]:
    assert engine.capture is not None
    assert native.lib.llama_attn_set_stable(engine.ctx, True) == 0
    yield
    assert native.lib.llama_attn_set_stable(engine.ctx, False) == 0


def _steps(
    engine: Engine, prompt: list[int], pattern: list[bool], cap: CaptureOptions | None = None
) -> tuple[list[np.ndarray | None], int]:
    """Prefill ``prompt`` on sequence 0, then decode one token per entry of ``pattern`` (the prompt's own tokens
    again, so every run computes the same), capturing where it is True.  Returns the captured rows and how
    many of those decodes reused the previous graph."""
    engine.erase(0)
    assert engine.decode([BatchEntry(0, 0, prompt, logits=True)]) == 0
    pos = len(prompt)
    rows: list[np.ndarray | None] = []
    reused = llama.llama_perf_context(engine.ctx).n_reused
    for k, capture in enumerate(pattern):
        target = engine.new_target(0, pos, cap) if capture else None
        assert engine.decode([BatchEntry(0, pos, [prompt[k]], logits=True, target=target)]) == 0
        rows.append(None if target is None else np.array(target.out, copy=True))
        pos += 1
    n = llama.llama_perf_context(engine.ctx).n_reused - reused
    engine.erase(0)
    return rows, n


def test_switching_capture_on_and_off_rebuilds_the_graph_by_default(engine: Engine, prompt: list[int]) -> None:
    assert engine.capture is not None and not engine.capture.stable  # a CPU engine: the lean graphs
    _, reused = _steps(engine, prompt, ALTERNATING)
    assert reused == 0, "each switch builds another graph"
    _, reused = _steps(engine, prompt, [True] * len(ALTERNATING))
    assert reused >= len(ALTERNATING) - 1, "the same shape every step is reused"


@pytest.mark.usefixtures("stable")
def test_a_stable_graph_is_reused_whether_or_not_a_step_captures(engine: Engine, prompt: list[int]) -> None:
    _, reused = _steps(engine, prompt, ALTERNATING)
    assert reused >= len(ALTERNATING) - 1, f"only {reused} of {len(ALTERNATING)} decodes reused the graph"


@pytest.mark.parametrize(
    "cap",
    [CaptureOptions(attention=True), CaptureOptions(attention=True, format="aggregated", dtype="float16")],
    ids=["per_layer-f32", "aggregated-f16"],
)
def test_a_stable_graph_gives_the_same_rows(engine: Engine, prompt: list[int], cap: CaptureOptions) -> None:
    lean, _ = _steps(engine, prompt, ALTERNATING, cap)
    assert native.lib.llama_attn_set_stable(engine.ctx, True) == 0
    try:
        kept, _ = _steps(engine, prompt, ALTERNATING, cap)
    finally:
        native.lib.llama_attn_set_stable(engine.ctx, False)
    assert [r is None for r in kept] == [not c for c in ALTERNATING]
    for k, (a, b) in enumerate(zip(lean, kept, strict=True)):
        if a is not None:
            assert b is not None and a.shape == b.shape, k
            np.testing.assert_allclose(b, a, atol=1e-6, err_msg=f"token {k}")


def test_rows_land_in_the_devices_host_buffer_type(engine: Engine, prompt: list[int]) -> None:
    """On a CPU backend the device has no pinned host buffer type: the rows go to CPU memory
    (a CUDA build names ``CUDA_Host``)."""
    rows, _ = _steps(engine, prompt, [True])
    assert rows[0] is not None
    assert native.lib.llama_attn_host_buffer(engine.ctx) == b"CPU"


def test_health_says_no_cuda_graphs_on_a_cpu_engine(engine: Engine) -> None:
    assert native.lib.llama_attn_cuda_graphs(engine.ctx) == -1  # no CUDA device in this model
    assert cuda_graphs(engine.ctx, 0) is None
    info = runtime_info(engine)
    assert info.cuda_graphs is None and info.capture_stable_graph is False


def test_capture_graph_stable_is_taken_on_a_cpu_engine(model) -> None:  # type: ignore[no-untyped-def]
    """``--capture-graph stable`` keeps one graph shape on a CPU engine too (what ``auto`` does on a GPU); /health
    says so; a decode without rows after one with rows reuses the graph."""
    eng = Engine(model, EngineSettings(n_ctx=512, n_slots=1, n_spare=0, n_threads=2, capture_graph="stable"))
    try:
        assert eng.capture is not None and eng.capture.stable
        assert runtime_info(eng).capture_stable_graph is True
        ids = model.tokenize(CHAT.format("Hi"), False, True)
        _, reused = _steps(eng, ids, [True, False, True, False])
        assert reused >= 3
    finally:
        eng.close()


def test_set_stable_before_the_capture_is_armed_is_refused() -> None:
    assert native.lib.llama_attn_set_stable(None, True) == -1


def test_decode_steps_without_rows_name_none_to_llama_cpp_again(
    engine: Engine, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step without attention after a step without attention makes no ``llama_attn_set_rows`` call (nothing
    to clear); the first step without rows after one with rows clears them, and rows asked again are captured."""
    calls: list[int] = []
    real = native.lib.llama_attn_set_rows

    def counting(ctx: object, idx: object, n: int) -> int:
        calls.append(n)
        return int(real(ctx, idx, n))

    _steps(engine, prompt, [False])  # whatever came before: llama.cpp now holds no rows
    monkeypatch.setattr(native.lib, "llama_attn_set_rows", counting)
    rows, _ = _steps(engine, prompt, [False, False, True, False, False, True])
    assert calls == [1, 0, 1], "set only when the rows change"
    assert [r is None for r in rows] == [True, True, False, True, True, False]
    assert all(np.isclose(r.sum(axis=-1), 1.0, atol=1e-3).all() for r in rows if r is not None)
