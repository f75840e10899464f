"""Start-up in every configuration the engine can choose, with the worker a subprocess as ``serve`` starts it.

Configurations: CPU weight repacking (llama.cpp's extra buffer types) on and off, flash
attention on and off; a worker that crashes during start-up (retried once
without repacking, or reported with its stage and signal); ``slotserve check``; the
engine configuration reported by ``/health`` and ``GET /api/v1/model``; ``/health``
while the model loads.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from contract.settings import EngineSettings
from orchestrator.check import run_check
from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.launch import EngineStartError, WorkerOptions
from tests.conftest import ROOT
from tests.tiny_models import build_tiny_gguf

FAULTS = ROOT / "tests" / "orchestrator" / "worker_faults.py"


def faulty_python(tmp_path: Path) -> str:
    """An interpreter stand-in that runs tests/orchestrator/worker_faults.py instead of ``-m engine.worker``."""
    wrapper = tmp_path / "python-with-faults"
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{FAULTS}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def faulty(tmp_path: Path, fault: str, **settings: object) -> WorkerOptions:
    """Worker options of a small engine whose worker has ``fault`` (tests/orchestrator/worker_faults.py)."""
    return WorkerOptions(
        EngineSettings(n_slots=1, n_spare=1, n_ctx=512, n_threads=2, **settings),  # type: ignore[arg-type]
        python=faulty_python(tmp_path), extra_env={"SLOTSERVE_TEST_FAULT": fault},
    )  # fmt: skip


def check(options: WorkerOptions) -> tuple[int, str]:
    out = io.StringIO()
    code = asyncio.run(run_check(options, Console(file=out, width=200, color_system=None)))
    return code, out.getvalue()


@pytest.mark.parametrize("repack", [True, False], ids=["repack", "no-repack"])
@pytest.mark.parametrize("flash_attn", ["on", "off"], ids=["fa-on", "fa-off"])
def test_check_passes_in_every_configuration(repack: bool, flash_attn: str) -> None:
    if repack and "AMX" in backend_extra_bufts_here():
        pytest.skip("an explicit --repack on a CPU offering AMX crashes in llama.cpp 0.3.36 (docs/hardware.md)")
    code, out = check(
        WorkerOptions(
            EngineSettings(n_slots=2, n_spare=1, n_ctx=512, n_threads=2, repack=repack, flash_attn=flash_attn)  # type: ignore[arg-type]
        )
    )
    assert code == 0, out
    assert "verdict: PASS" in out
    assert f"repack {'on' if repack else 'off'} (requested" in out
    assert f"capture graph, flash attention {flash_attn} (requested (--flash-attn {flash_attn}))," in out
    assert out.count("ok  ") >= 6, out


def test_crash_during_start_up_is_retried_without_repacking(tmp_path: Path) -> None:
    options = faulty(tmp_path, "segv-unless-no-repack")

    async def run() -> None:
        client = WorkerClient(options, restart=False)
        info = await client.start()
        try:
            assert client.options.engine.repack is False
            assert info.runtime.use_extra_bufts is False
            assert info.runtime.repack_reason == "requested (--no-repack)"
            reply = await client.tokenize("hello", False, False)
            assert reply.ids
        finally:
            await client.close()

    asyncio.run(run())


def test_crash_is_reported_with_stage_and_signal(tmp_path: Path) -> None:
    options = faulty(tmp_path, "segv-always")

    async def run() -> EngineStartError:
        client = WorkerClient(options, restart=False)
        with pytest.raises(EngineStartError) as info:
            await client.start()
        assert client.pid is not None
        return info.value

    err = asyncio.run(run())
    assert err.crashed and err.returncode == -11
    assert err.stage == "self_check"
    assert "SIGSEGV" in str(err) and "self_check" in str(err)


def test_explicit_repack_is_not_second_guessed(tmp_path: Path) -> None:
    options = faulty(tmp_path, "segv-unless-no-repack", repack=True)

    async def run() -> None:
        with pytest.raises(EngineStartError) as info:
            await WorkerClient(options, restart=False).start()
        assert info.value.stage == "self_check"

    asyncio.run(run())


def test_check_command_fails_when_the_engine_crashes(tmp_path: Path) -> None:
    options = faulty(tmp_path, "segv-always", repack=False)
    code, out = check(options)
    assert code == 1
    assert "FAIL start-up" in out and "SIGSEGV" in out and "verdict: FAIL" in out


def test_check_cli_exit_status() -> None:
    """``slotserve check`` as a user runs it (default configuration)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "check", "--ctx-size", "512", "--parallel", "2", "--threads", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict: PASS" in out.stdout
    assert "reduced attention" in out.stdout and "the same tokens True" in out.stdout


def test_serve_reports_engine_configuration(server) -> None:  # type: ignore[no-untyped-def]
    from engine import backend

    health = httpx.get(server.url + "/health").json()
    cfg = health["engine_config"]
    assert cfg["backend"] == "CPU" and cfg["n_layers_offloaded"] == 0
    assert cfg["flash_attn"] is False and cfg["flash_attn_reason"].startswith("auto: off on a CPU")
    assert cfg["type_k"] == "f16" and cfg["type_v"] == "f16"
    assert cfg["n_threads"] == 2 and cfg["kv_unified"] is False
    assert cfg["repack_reason"].startswith("auto:")
    assert cfg["extra_bufts"] == backend_extra_bufts_here()
    expect = backend.choose_repack(None, cfg["extra_bufts"]).use_extra_bufts
    assert cfg["use_extra_bufts"] is expect
    assert any(d.startswith("CPU") for d in cfg["devices"])
    model = httpx.get(server.url + "/api/v1/model").json()
    assert model["engine"] == cfg


def backend_extra_bufts_here() -> list[str]:
    """The CPU extra buffer types, asked of a fresh interpreter (llama.cpp loaded the same way)."""
    code = "from engine.model import init_backend; init_backend(); from engine import backend; print(backend.cpu_extra_bufts())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return eval(out.stdout.strip().splitlines()[-1])  # a printed list of names


def test_health_says_loading_with_progress(start_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import ServerProc

    srv = ServerProc(
        ["--threads", "2", "--ctx-size", "512", "--parallel", "1", "--no-persist"], tmp_path,
        {"SLOTSERVE_TEST_FAULT": "slow-load", "SLOTSERVE_WORKER_PYTHON": faulty_python(tmp_path)},
    )  # fmt: skip
    seen: list[dict] = []
    try:
        srv.start_process()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append({"status_code": r.status_code, **r.json()})
            if r.status_code == 200:
                break
            time.sleep(0.05)
    finally:
        srv.stop()
    loading = [s for s in seen if s["status_code"] == 503]
    assert loading and all(s["status"] == "loading" and s["error_code"] == "NO_MODEL" for s in loading)
    fractions = [s["progress"] for s in loading if s.get("stage") == "loading_model" and "progress" in s]
    assert fractions and fractions == sorted(fractions) and any(0 < f < 1 for f in fractions)
    assert seen[-1]["status_code"] == 200 and seen[-1]["status"] == "ok"


def test_small_context_starts() -> None:
    """A window smaller than llama.cpp's 256-cell padding: the capture is sized by the cells llama.cpp made."""
    code, out = check(WorkerOptions(EngineSettings(n_slots=1, n_spare=1, n_ctx=64, n_threads=2)))
    assert code == 0, out
    assert "verdict: PASS" in out


def test_check_with_an_f32_kv_cache() -> None:
    """``--cache-type-k f32 --cache-type-v f32`` reach the worker and its reported configuration."""
    code, out = check(
        WorkerOptions(EngineSettings(n_slots=1, n_spare=1, n_ctx=256, n_threads=2, type_k="f32", type_v="f32"))
    )
    assert code == 0, out
    assert "KV f32/f32," in out


def test_quantized_v_cache_without_flash_attention_is_refused_on_the_command_line() -> None:
    """A quantized V cache needs flash attention: with ``--flash-attn off`` it is refused before anything starts."""
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "check", "--cache-type-v", "q8_0", "--flash-attn", "off"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--cache-type-v q8_0 needs flash attention" in out.stderr


def test_check_with_a_quantized_v_cache() -> None:
    """``-ctv q8_0`` under ``--flash-attn auto`` turns flash attention on (V stored by rows, rows from the
    side branch), and the capture is still exact enough to pass."""
    code, out = check(
        WorkerOptions(EngineSettings(n_slots=1, n_spare=1, n_ctx=256, n_threads=2, type_k="q8_0", type_v="q8_0"))
    )
    assert code == 0, out
    assert "KV q8_0/q8_0," in out and "flash attention on (auto: on (a q8_0 V cache needs" in out


def test_check_passes_on_a_model_with_attention_sinks(tmp_path: Path) -> None:
    """gpt-oss's learned attention sinks take part of each softmax, so its rows sum to less than 1: ``slotserve
    check`` accepts rows in (0, 1] on such a model (it failed every gpt-oss before) and still recomputes them."""
    gguf = build_tiny_gguf("gpt-oss", tmp_path)
    code, out = check(WorkerOptions(EngineSettings(model=str(gguf), n_slots=2, n_spare=1, n_ctx=512, n_threads=2)))
    assert code == 0, out
    assert "sum to at most 1 True" in out and "recomputed attention" in out
