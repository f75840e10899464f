"""Reduced attention: one token's rows reduced in the worker, so only the reduced bytes cross the socket.

The graph (libllama/llama-attn.h) computes the rows per layer and head (``per_layer``) or their mean
(``aggregated``), or per layer and head the ``topk`` largest weights where the graph selects them;
:func:`reduce_rows` turns a token's rows, already gathered into input-position order (:mod:`engine.capture`),
and :func:`select_top_k` the graph's top ``k``, into the format a client asked for
(:class:`contract.options.CaptureOptions`, docs/api.md "Attention formats"): a head subset, the ``topk``
weights per layer and head with their positions, the mass per ``spans`` entry, and the ``sink`` figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contract.options import AttentionDtype, AttentionFormat, CaptureOptions


@dataclass
class Reduced:
    """One token's reduced attention: ``weights`` in the stream's dtype (``float32``/``float16``);
    ``positions`` ``int32`` of ``weights``' shape (``topk`` only, else None); ``sink`` the mass on the
    first ``CaptureOptions.sink`` positions (None when not asked)."""

    weights: np.ndarray
    positions: np.ndarray | None = None
    sink: float | None = None


def graph_format(cap: CaptureOptions, max_top_k: int = 0) -> tuple[AttentionFormat, AttentionDtype]:
    """``(format, dtype)`` the graph must compute for ``cap``: the request's own when no reduction is asked;
    ``aggregated`` float32 for ``spans``/``sink`` over every head (a mean over layers and heads is linear);
    ``topk`` float32 (every head's, :func:`select_top_k` picks) for ``topk`` without ``sink`` where the graph
    selects up to ``max_top_k`` (``llama_attn_max_top_k``); else ``per_layer`` float32."""
    if not cap.reduced:
        return cap.format, cap.dtype
    if cap.heads is None and cap.format in ("aggregated", "spans"):
        return "aggregated", "float32"
    if cap.format == "topk" and cap.sink == 0 and 1 <= cap.top_k <= max_top_k:
        return "topk", "float32"
    return "per_layer", "float32"


def select_top_k(weights: np.ndarray, positions: np.ndarray, cap: CaptureOptions, n: int) -> Reduced:
    """``cap``'s ``topk`` from the graph's: ``weights`` ``float32[L, H, K]`` best first and their ``positions``
    ``int32[L, H, K]`` (every head, ``K >= cap.top_k``) for a token with ``n`` positions of context.  Returns
    what :func:`reduce_rows` returns for the full rows: the heads of ``cap.heads``, the first ``min(top_k, n)``,
    in ``cap.dtype``.  A position -1 (a weight of 0 the graph found at no position of the context: fewer than
    ``top_k`` weights above 0) becomes the least position its row does not name yet, a weight of 0 too."""
    if cap.heads is not None:
        weights, positions = weights[:, cap.heads], positions[:, cap.heads]
    k = min(cap.top_k, n)
    dtype = np.float16 if cap.dtype == "float16" else np.float32
    positions = np.array(positions[..., :k], dtype=np.int32, order="C")
    rows = positions.reshape(-1, k)  # a view: rows[r] is written in place
    for r in np.flatnonzero((rows < 0).any(axis=1)):
        row = rows[r]
        unused = np.setdiff1d(np.arange(n, dtype=np.int32), row[row >= 0], assume_unique=True)
        row[row < 0] = unused[: int((row < 0).sum())]
    return Reduced(np.ascontiguousarray(weights[..., :k], dtype=dtype), positions)


def reduce_rows(rows: np.ndarray, cap: CaptureOptions) -> Reduced:
    """Reduce one token's rows to ``cap``'s format.

    ``rows``: the graph's output for ``cap`` (:func:`graph_format`) in input-position order: ``float32[L, H, n]``
    (the requested layers in the request's order, every head) or ``float32[n]`` (already the mean over layers
    and heads).  Returns :class:`Reduced`: ``per_layer`` ``[L, H_sel, n]``; ``aggregated`` ``[n]``; ``topk``
    ``[L, H_sel, min(top_k, n)]`` weights best first (ties: any order) with their positions; ``spans``
    ``[len(spans)]``, positions at or past ``n`` counting 0.  Raises ``IndexError`` for a head index outside
    ``rows`` (the orchestrator checks them first).
    """
    if rows.ndim == 3 and cap.heads is not None:
        rows = rows[:, cap.heads]
    sink = None
    if cap.sink > 0:
        mean = rows if rows.ndim == 1 else rows.mean(axis=(0, 1), dtype=np.float32)
        sink = float(mean[: cap.sink].sum(dtype=np.float32))
    positions = None
    if cap.format == "topk":
        k = min(cap.top_k, rows.shape[-1])
        part = np.argpartition(rows, rows.shape[-1] - k, axis=-1)[..., rows.shape[-1] - k :]
        vals = np.take_along_axis(rows, part, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")
        weights = np.take_along_axis(vals, order, axis=-1)
        positions = np.take_along_axis(part, order, axis=-1).astype(np.int32)
    elif cap.format in ("aggregated", "spans"):
        weights = rows if rows.ndim == 1 else rows.mean(axis=(0, 1), dtype=np.float32)
        if cap.format == "spans":
            sums = np.concatenate(([0.0], np.cumsum(weights, dtype=np.float64)))
            n = len(weights)
            weights = np.array([sums[min(e, n)] - sums[min(s, n)] for s, e in cap.spans], dtype=np.float32)
    else:
        weights = rows
    dtype = np.float16 if cap.dtype == "float16" else np.float32
    return Reduced(np.ascontiguousarray(weights, dtype=dtype), positions, sink)
