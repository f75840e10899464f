"""The start-up self-check: real decodes that prove the attention capture and the state round trip.

:class:`engine.engine.Engine` runs it once, at the end of its creation (the worker reports the stage
``self_check``; the HTTP port does not open until it passes), and learns from it the engine's state layout
(:attr:`engine.engine.Engine.layout`), which every restore then checks states against.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from contract.model_facts import SINK_ARCHITECTURES, attention_rows_sum_ok
from contract.settings import EngineSettings
from engine.batch import BatchEntry
from engine.capture import AttentionCapture, CaptureError, RowTarget
from engine.model import Model
from slotstate import seq_state


class CheckedEngine(Protocol):
    """What the self-check uses of :class:`engine.engine.Engine` (which calls it from its constructor): declared
    here, so that this module does not import the engine's and the dependency runs one way."""

    model: Model
    config: EngineSettings
    n_swa: int
    shape: seq_state.StateShape
    capture: AttentionCapture | None
    layout: seq_state.StateLayout

    @property
    def attention_layers(self) -> tuple[int, ...]: ...
    def layer_window(self, il: int) -> int: ...
    def new_target(self, seq: int, pos: int) -> RowTarget: ...
    def decode_in_batches(self, entry: BatchEntry) -> int: ...
    def save_state(self, seq: int) -> tuple[list[int], bytearray | memoryview]: ...
    def release_state(self, state: bytearray | memoryview) -> None: ...
    def restore_state(self, seq: int, tokens: Sequence[int], blob: bytes | bytearray | memoryview) -> None: ...
    def erase(self, seq: int) -> None: ...
    def release_empty(self) -> int: ...


def run_self_check(engine: CheckedEngine) -> float:
    """Check the capture and the states of ``engine`` on real decodes; learn its state layout
    (sets :attr:`engine.engine.Engine.layout`).

    While another sequence holds cells (when there are two), decodes a prompt on a spare
    sequence (past the sliding window of a sliding-window model, when ``n_ctx`` goes past it),
    capturing its last row: every attention layer must be captured, each head's row must sum to
    1 (less than 1 with attention sinks: :data:`contract.model_facts.SINK_ARCHITECTURES`) and a sliding
    layer's must be 0 before its window (rows mapped through the wrong KV cache's cells would not be).
    The prompt goes in batches of at most ``n_batch`` tokens (:meth:`engine.engine.Engine.decode_in_batches`).
    Then saves the sequence's state (every part of the model's memory), restores it and decodes one token
    more from it, capturing again; its sequences' KV streams are then given back
    (:meth:`engine.engine.Engine.release_empty`).  Returns the milliseconds it took.
    Raises :class:`engine.capture.CaptureError` when a check fails.
    """
    s = engine.config.n_seq_max - 1
    t0 = time.perf_counter()
    seed = engine.model.tokenize("Hello world", False, False) or [0]
    # past the window where the context allows it (a window >= n_ctx never cuts a row off)
    n = engine.n_swa + 4 if engine.n_swa > 0 and engine.n_swa + 4 < engine.config.n_ctx else 3
    toks = (seed * (n // len(seed) + 1))[:n]
    if s > 0:
        _check_decode(engine, s - 1, 0, seed[:2])
    _check_decode(engine, s, 0, toks)
    _, state = engine.save_state(s)
    own = bytearray(state)  # a copy of its own: the state's memory goes back to the pool
    engine.release_state(state)
    engine.layout = seq_state.parse(own, shape=engine.shape).layout
    engine.restore_state(s, toks, own)
    _check_decode(engine, s, len(toks), seed[:1])
    engine.erase(s)
    if s > 0:
        engine.erase(s - 1)
    engine.release_empty()  # every stream was cleared, so resident, at creation
    return (time.perf_counter() - t0) * 1000


def _check_decode(engine: CheckedEngine, seq: int, pos0: int, toks: list[int]) -> None:
    """Decode ``toks`` on ``seq`` from ``pos0`` capturing the last row, and check it (:func:`run_self_check`)."""
    pos = pos0 + len(toks) - 1
    target = engine.new_target(seq, pos) if engine.capture is not None else None
    status = engine.decode_in_batches(BatchEntry(seq, pos0, toks, logits=True, target=target))
    if status != 0:
        raise CaptureError(f"self-check decode failed with status {status}")
    if engine.capture is None or target is None:
        return
    seen, expect = engine.capture.n_captured(), len(engine.attention_layers)
    rows = target.out if target.out is not None else np.zeros((1, 1, 1), dtype=np.float32)
    sums = rows.sum(axis=-1)
    outside = [
        float(rows[k, :, : max(0, pos + 1 - engine.layer_window(il))].sum(axis=-1).max())
        for k, il in enumerate(engine.attention_layers)
        if engine.layer_window(il)
    ]
    sums_ok = attention_rows_sum_ok(sums, engine.model.meta("general.architecture") in SINK_ARCHITECTURES)
    if seen != expect or not sums_ok or max(outside, default=0.0) > 1e-3:
        raise CaptureError(
            f"attention capture self-check failed: {seen} of {expect} layers captured, "
            f"row sums {sums.ravel()[:4]}, largest weight before a sliding window {max(outside, default=0.0):.3g}"
        )
