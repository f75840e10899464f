"""The orchestrator's engine interface: the worker client implements it, and the API process never loads llama.cpp."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.interface import EngineClient
from orchestrator.engine_client.launch import WorkerOptions
from tests.conftest import ROOT


def test_worker_client_implements_the_protocol() -> None:
    """A :class:`WorkerClient` is an :class:`EngineClient`, each method with the protocol's parameters."""
    client = WorkerClient(WorkerOptions(), restart=False)  # not started: nothing runs
    assert isinstance(client, EngineClient)
    methods = {n: m for n, m in vars(EngineClient).items() if inspect.isfunction(m) and not n.startswith("_")}
    assert {"generate", "preview", "erase", "fork", "context_shift", "save_state", "restore_state"} <= set(methods)
    for name, member in methods.items():
        got = getattr(WorkerClient, name)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(member), name
        assert list(inspect.signature(got).parameters) == list(inspect.signature(member).parameters), name
    assert not client.alive and client.info is None and client.pieces == [] and client.generation == 0


def test_the_api_process_does_not_load_llama_cpp() -> None:
    """Importing the whole app (every route, the worker client, the protocol) leaves llama.cpp unloaded."""
    code = (
        "import sys, orchestrator.app, orchestrator.cli, orchestrator.check\n"
        "bad = sorted(m for m in sys.modules if m == 'llama_cpp' or m.startswith('llama_cpp.'))\n"
        "engine = sorted(m for m in sys.modules if m == 'engine' or m.startswith('engine.'))\n"
        "contract = sorted(m for m in sys.modules if m.startswith('contract.'))\n"
        "import json; print(json.dumps({'engine': engine, 'contract': contract}))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    loaded = out.stdout
    modules = json.loads(loaded)
    assert "contract.protocol" in modules["contract"] and modules["engine"] == [], loaded  # no worker code at all
