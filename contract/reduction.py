"""The rules of reduced attention requests (docs/api.md, "Attention formats"), checked by the orchestrator
before a request reaches the worker and by the worker again before it admits one."""

from __future__ import annotations

from contract.options import CaptureOptions


def reduction_error(cap: CaptureOptions, n_head: int, n_ctx: int, n_input: int) -> str | None:
    """Why ``cap``'s reduction is refused, or None when it is valid.

    ``n_head``: the model's query heads; ``n_ctx``: the context size in tokens; ``n_input``: the request's
    input length in tokens (``spans`` lie within it).  Rules: ``top_k`` only with format ``topk``, where
    ``1 <= top_k <= n_ctx``; ``spans`` only with format ``spans``, non-empty, each ``[start, end)`` with
    ``0 <= start < end <= n_input``, sorted and disjoint; ``heads`` distinct indices ``0 <= h < n_head``,
    at least one; ``sink`` at most ``n_ctx``.
    """
    if not cap.attention:
        return None
    if cap.format == "topk":
        if not 1 <= cap.top_k <= n_ctx:
            return f"attention_top_k must be 1..{n_ctx} (n_ctx) with attention_format topk, not {cap.top_k}"
    elif cap.top_k:
        return "attention_top_k needs attention_format topk"
    if cap.format == "spans":
        if not cap.spans:
            return "attention_format spans needs attention_spans or a prompt with at least one message"
        end = 0
        for start, stop in cap.spans:
            if start < end or start >= stop or stop > n_input:
                return (
                    f"attention_spans must be sorted, disjoint, non-empty [start, end) ranges within the "
                    f"{n_input} input positions: [{start}, {stop}) is not"
                )
            end = stop
    elif cap.spans:
        return "attention_spans needs attention_format spans"
    if cap.heads is not None and (
        not cap.heads or len(set(cap.heads)) != len(cap.heads) or any(not 0 <= h < n_head for h in cap.heads)
    ):
        return f"attention_heads must be distinct head indices 0..{n_head - 1}"
    if not 0 <= cap.sink <= n_ctx:
        return f"attention_sink must be 0..{n_ctx} (n_ctx), not {cap.sink}"
    return None
