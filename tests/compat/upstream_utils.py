"""llama.cpp's ``tools/server/tests/utils.py`` with its launcher swapped for ``slotserve serve``.

:mod:`tests.compat.upstream` runs the pinned llama.cpp's server test files
(``vendor/llama.cpp/tools/server/tests/unit``) unchanged against slotserve; their
``from utils import *`` finds this module.  It loads llama.cpp's own ``utils.py`` (its
``ServerProcess``, ``ServerPreset``, request helpers: unchanged) and replaces only
``ServerProcess.start``: the preset's options become ``slotserve serve`` flags
(:data:`FLAGS`), options slotserve does not offer stop the test with
:class:`NotOffered`, and a preset model other than ``tinyllama2`` (stories260K, which
slotserve stands in for with its default model) with :class:`NeedsTestModel`, so a
failure's first line says which of the two it is.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TESTS = ROOT.parent / "llama" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "tools" / "server" / "tests"
UPSTREAM = Path(os.environ.get("LLAMA_SERVER_TESTS", str(LLAMA_TESTS)))
STAND_IN_REPO = "ggml-org/test-model-stories260K"  # tinyllama2: served by slotserve's default model


class NotOffered(RuntimeError):
    """A llama-server option slotserve does not offer (the test needs a flag we do not offer)."""


class NeedsTestModel(RuntimeError):
    """The test needs one of llama-server's own test models (embedding, reranker, infill, vision...)."""


def _load_upstream() -> types.ModuleType:
    sys.modules.setdefault("wget", types.ModuleType("wget"))  # downloads only: never used offline
    spec = importlib.util.spec_from_file_location("llama_server_test_utils", UPSTREAM / "utils.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_up = _load_upstream()
globals().update({k: v for k, v in vars(_up).items() if not k.startswith("__")})
ServerProcess = _up.ServerProcess

# attribute -> slotserve flag (a value flag, or None for a switch)
FLAGS: dict[str, tuple[str, bool]] = {
    "n_ctx": ("--ctx-size", True),
    "n_batch": ("--batch-size", True),
    "n_ubatch": ("--ubatch-size", True),
    "n_slots": ("--parallel", True),
    "n_predict": ("--n-predict", True),
    "n_threads": ("--threads", True),
    "slot_save_path": ("--slot-save-path", True),
    "api_key": ("--api-key", True),
    "ctk": ("--cache-type-k", True),
    "ctv": ("--cache-type-v", True),
    "fa": ("--flash-attn", True),
    "model_alias": ("--alias", True),
    "model_tags": ("--tags", True),
    "cors_origins": ("--cors-origin", True),
    "swa_full": ("--swa-full", False),
    "enable_ctx_shift": ("--context-shift", False),
    "server_embeddings": ("--embeddings", False),
    "no_ui": ("--no-ui", False),
}
# options slotserve has as its fixed behaviour (the value the tests set is what it does anyway)
ALWAYS = {"server_continuous_batching", "server_metrics", "jinja", "kv_unified", "n_gpu_layer", "offline"}
NOT_OFFERED = ("model_draft", "n_ga", "n_ga_w", "lora_files", "pooling", "server_reranking", "spec_type",
               "spec_draft_n_min", "spec_draft_n_max", "spec_synth_len", "spec_synth_rates", "reasoning_format",
               "reasoning", "chat_template", "chat_template_file", "mmproj_url", "media_path", "sleep_idle_seconds",
               "cache_ram", "no_cache_idle_slots", "ui_mcp_proxy", "backend_sampling", "gcp_compat", "server_tools",
               "server_tools_runtime", "mcp_servers_config", "mcp_servers_json", "models_dir", "models_max",
               "models_preset", "no_models_autoload", "no_mmproj")  # fmt: skip


def slotserve_args(server: Any) -> list[str]:
    """``slotserve serve`` flags for a llama.cpp ``ServerProcess``'s options; raises
    :class:`NeedsTestModel` or :class:`NotOffered` for what slotserve cannot stand in for."""
    if not (server.model_file or server.model_url or server.model_hf_repo):
        raise NotOffered("needs a flag we do not offer: llama-server's router mode (no model, --models-dir)")
    if server.model_file or server.model_url or server.model_hf_repo != STAND_IN_REPO:
        raise NeedsTestModel(f"needs llama-server's test model {server.model_hf_repo or server.model_file}")
    if server.model_hf_file and server.model_hf_repo == STAND_IN_REPO:
        raise NeedsTestModel(f"needs llama-server's test model {server.model_hf_file}")
    set_but_not_offered = [name for name in NOT_OFFERED if getattr(server, name, None) not in (None, False, 0, "")]
    if set_but_not_offered:
        raise NotOffered(f"needs a flag we do not offer: {', '.join(set_but_not_offered)}")
    args = ["--port", str(server.server_port), "--host", server.server_host, "--seed", str(server.seed)]
    for name, (flag, takes_value) in FLAGS.items():
        value = getattr(server, name, None)
        if value in (None, False, ""):
            continue
        if name == "n_ctx" and not server.kv_unified:  # llama-server's -c is shared by its -np slots
            value = value // (server.n_slots or 1)
        args += [flag, str(value)] if takes_value else [flag]
    if not server.server_slots:
        args.append("--no-slots")
    return args


def start(self: Any, timeout_seconds: float = 120) -> None:
    """``ServerProcess.start``: ``slotserve serve`` with the mapped flags, waited for as llama.cpp waits."""
    if getattr(self, "_free_port", None) is None:  # one port per server, kept across restarts as llama.cpp's tests do
        self._free_port = _up_free_port()
    self.server_port = self._free_port
    workdir = tempfile.mkdtemp(prefix="llama-upstream-")
    args = [sys.executable, "-m", "orchestrator.cli", "serve", *slotserve_args(self),
            "--state-dir", os.path.join(workdir, "state")]  # fmt: skip
    if self.n_threads is None:
        args += ["--threads", "2"]
    self._log = open(os.path.join(workdir, "server.log"), "ab")  # noqa: SIM115 - closed by stop()
    self.process = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
    _up.server_instances.add(self)
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if self.process.poll() is not None:
            raise RuntimeError(f"slotserve exited with {self.process.returncode}: see {workdir}/server.log")
        try:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            if self.make_request("GET", "/health", headers=headers, timeout=2).status_code == 200:
                self.ready = True
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.1)
    raise TimeoutError("slotserve did not become healthy")


def _up_free_port() -> int:
    from tests.redis_server import free_port

    return free_port()


ServerProcess.start = start
