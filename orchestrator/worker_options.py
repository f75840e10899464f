"""How the orchestrator starts its engine worker: the worker's command line and environment."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class WorkerOptions:
    """How to start the worker (mirrors ``engine.worker``'s command line)."""

    model: Path | None = None
    ctx_size: int = 4096
    parallel: int = 4
    spare: int = 4
    threads: int = max(1, os.cpu_count() or 1)
    batch_size: int = 512
    ubatch_size: int = 512
    n_gpu_layers: int = 0
    verify_cells: bool = False
    cache_idle_slots: bool = True
    repack: bool | None = None  # CPU weight repacking (extra buffer types); None: the worker decides
    eval_filter: bool = True  # the C eval-callback filter for attention rows, when built
    cache_type_k: str = "f16"  # KV cache types (llama-server's -ctk / -ctv names, engine/kv_types.py)
    cache_type_v: str = "f16"
    classifier: bool = False  # serve ``model`` as a sequence classifier (``Classify`` requests only)
    connect: str | None = None  # tcp:host:port of a standalone worker instead of spawning one
    extra_env: dict[str, str] = field(default_factory=dict)
    # the interpreter that runs the worker (e.g. another venv's, with a GPU build of llama.cpp)
    python: str = field(default_factory=lambda: os.environ.get("SLOTSERVE_WORKER_PYTHON", sys.executable))

    def argv(self, address: str) -> list[str]:
        """Command line for a spawned worker that connects back to ``address``."""
        args = [self.python, "-m", "engine.worker", "--connect", address]
        if self.model is not None:
            args += ["--model", str(self.model)]
        args += ["--ctx-size", str(self.ctx_size), "--parallel", str(self.parallel), "--spare", str(self.spare)]
        args += ["--threads", str(self.threads), "--batch-size", str(self.batch_size)]
        args += ["--ubatch-size", str(self.ubatch_size), "--n-gpu-layers", str(self.n_gpu_layers)]
        if (self.cache_type_k, self.cache_type_v) != ("f16", "f16"):
            args += ["--cache-type-k", self.cache_type_k, "--cache-type-v", self.cache_type_v]
        if self.verify_cells:
            args.append("--verify-cells")
        if not self.cache_idle_slots:
            args.append("--no-cache-idle-slots")
        if self.repack is not None:
            args.append("--repack" if self.repack else "--no-repack")
        if not self.eval_filter:
            args.append("--no-eval-filter")
        if self.classifier:
            args.append("--classifier")
        return args
