"""What the state integrity checks cost, on a real slot state of ``--tokens`` (2000) tokens.

The state comes from the engine in this process (SmolLM2-135M by default, no attention capture):
``--tokens`` of text are prefilled into one sequence and read with ``llama_state_seq_get_data``.
Timed on those bytes, median of ``--reps``:

- ``seq_state.parse``: the layout check every restore already did;
- ``seq_state.check_finite``: the non-finite K/V scan the worker adds to every restore;
- ``state_digest`` (XXH3-128): the store's checksum, computed on save and checked on load;
- SHA-256: the ``Repr-Digest`` of ``save-state`` (and of ``restore-state`` when a client sends one);
- zstd level 3 of the same bytes, for scale (the store compresses every save).

    .venv/bin/python benchmarks/bench_integrity.py [--tokens 2000] [--reps 7] [--model PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common import build_prompt, model_tokenizer
from servers import default_model


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def real_state(model_path: Path, n_tokens: int) -> bytes:
    """A sequence state of ``n_tokens`` prefilled tokens."""
    from contract.settings import EngineSettings
    from engine.batch import BatchEntry
    from engine.engine import Engine
    from engine.model import Model

    model = Model(model_path)
    eng = Engine(model, EngineSettings(n_ctx=n_tokens + 16, n_slots=1, n_spare=0, capture=False))
    ids = build_prompt(model_tokenizer(model), n_tokens)
    for start in range(0, n_tokens, 512):
        chunk = ids[start : start + 512]
        status = eng.decode([BatchEntry(0, start, chunk, logits=start + len(chunk) == n_tokens)])
        assert status == 0, status
    _, state = eng.save_state(0)
    blob = bytes(state)
    eng.close()
    model.close()
    return blob


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()

    import zstandard

    from slotstate import seq_state
    from storage.slot_codec import state_digest

    blob = real_state(args.model or default_model(), args.tokens)
    mb = len(blob) / 1e6
    parsed = seq_state.parse(blob)
    kv_mb = sum(size for _, _, size in parsed.data) / 1e6
    rows = [
        ("seq_state.parse (layout)", lambda: seq_state.parse(blob)),
        ("seq_state.check_finite", lambda: seq_state.check_finite(blob, parsed)),
        ("state_digest (XXH3-128)", lambda: state_digest(blob)),
        ("SHA-256 (Repr-Digest)", lambda: hashlib.sha256(blob).digest()),
        ("zstd level 3 (for scale)", lambda: zstandard.ZstdCompressor(level=3).compress(blob)),
    ]
    print(f"state of {args.tokens} tokens: {mb:.1f} MB ({kv_mb:.1f} MB of K/V values); median of {args.reps}")
    print(f"{'step':28} {'ms':>8} {'ms/MB':>8} {'GB/s':>7}")
    for name, fn in rows:
        s = timed(fn, args.reps)
        print(f"{name:28} {s * 1e3:8.2f} {s * 1e3 / mb:8.3f} {mb / 1e3 / s:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
