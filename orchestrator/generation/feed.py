"""What the admin page watches live: each generated token's attention, as the client got it.

:class:`GenerationService` publishes every :class:`~orchestrator.generation.service.TokenOut`
of a generation here (the same bytes its client receives); each admin subscriber
reduces the rows it wants to one ``float32[n_ctx]`` heatmap row: the mean over all
layers and heads, or over the heads of one layer when the client asked for
``per_layer`` attention.  Publishing never waits: a subscriber that falls behind
loses its oldest rows, never slows a generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

QUEUE_ROWS = 64  # rows a slow admin page may fall behind before the oldest are dropped


class TokenOut(Protocol):
    """What the feed reads of a generated token (:class:`orchestrator.generation.service.TokenOut`, which
    imports this module: the feed names the fields instead of importing it back)."""

    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def attention(self) -> bytes | None: ...
    @property
    def attention_shape(self) -> list[int]: ...


@dataclass(frozen=True)
class AttentionRow:
    """One generated token's attention over the context, reduced for the heatmap.

    ``values``: ``float32[n_ctx]`` (input positions); ``layer`` the layer it is the
    head mean of, or None for the mean over every captured layer and head.
    """

    slot_id: str
    index: int
    text: str
    layer: int | None
    values: np.ndarray


def reduce_row(t: TokenOut, fmt: str, dtype: str, layers: list[int] | None, layer: int | None) -> np.ndarray | None:
    """``float32[n_ctx]`` from a token's attention bytes (``[L, H, n_ctx]`` or ``[n_ctx]``), or None.

    ``layer`` picks one model layer (its heads' mean) from ``per_layer`` attention
    whose captured ``layers`` (None: all) include it; None means the mean of all.  None for the reduced
    formats ``topk`` and ``spans`` (no row over the context; docs/api.md, "Attention formats").
    """
    if t.attention is None or fmt not in ("per_layer", "aggregated"):
        return None
    arr = np.frombuffer(t.attention, dtype=np.float16 if dtype == "float16" else np.float32)
    arr = arr.reshape(t.attention_shape).astype(np.float32)
    if fmt == "aggregated":
        return arr if layer is None else None
    if layer is None:
        return arr.mean(axis=(0, 1))
    sel = list(range(arr.shape[0])) if layers is None else layers
    if layer not in sel:
        return None
    return arr[sel.index(layer)].mean(axis=0)


class Subscriber:
    """One admin page's view: which layer it shows and the rows waiting for it."""

    def __init__(self, layer: int | None) -> None:
        self.layer = layer
        self.queue: asyncio.Queue[AttentionRow] = asyncio.Queue(QUEUE_ROWS)

    def offer(self, row: AttentionRow) -> None:
        """Queue ``row``, dropping the oldest when full."""
        if self.queue.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                self.queue.get_nowait()
        self.queue.put_nowait(row)


class AttentionFeed:
    """Fan-out of generated tokens' attention to admin subscribers (see module docstring)."""

    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()

    def subscribe(self, layer: int | None) -> Subscriber:
        """A new subscriber for ``layer`` (None: mean of all layers)."""
        sub = Subscriber(layer)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        """Stop feeding ``sub``."""
        self.subscribers.discard(sub)

    def publish(self, slot_id: str, t: TokenOut, fmt: str, dtype: str, layers: list[int] | None) -> None:
        """Hand ``t`` to every subscriber (no-op without subscribers or attention)."""
        if not self.subscribers or t.attention is None:
            return
        for sub in list(self.subscribers):
            values = reduce_row(t, fmt, dtype, layers, sub.layer)
            if values is not None:
                sub.offer(AttentionRow(slot_id, t.index, t.text, sub.layer, values))
