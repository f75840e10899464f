"""One sequence's part of a llama.cpp decode batch (``llama_batch``, ``include/llama.h``).

The batcher (:mod:`engine.batcher`) and the start-up self-check (:mod:`engine.self_check`) describe a decode as
a list of :class:`BatchEntry`; :meth:`engine.engine.Engine.decode` writes them into the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.capture import RowTarget


@dataclass
class BatchEntry:
    """Tokens of one sequence in a decode: ``tokens`` at positions ``pos0..``.

    ``target`` (optional) captures the attention row of the last token; ``logits`` asks
    llama.cpp for the last token's logits.  ``batch_start`` is set by :meth:`engine.engine.Engine.decode`.
    """

    seq: int
    pos0: int
    tokens: Sequence[int]
    logits: bool = False
    target: RowTarget | None = None
    batch_start: int = 0
