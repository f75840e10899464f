"""Capture options of a generation: the attention a client asked for, checked against the model.

The formats (docs/api.md, "Attention formats"): ``per_layer`` and ``aggregated`` rows, and the reductions the
worker computes (``topk``, ``spans``, a head subset, the ``sink`` figure; :mod:`engine.reduce`).  The rules of
a reduction are :func:`contract.reduction.reduction_error`'s, checked here first so that a bad request is a
400 before it holds a slot or reaches the worker.
"""

from __future__ import annotations

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.options import CaptureOptions
from contract.reduction import reduction_error
from orchestrator.generation.request import CanonicalRequest
from orchestrator.service_error import ServiceError
from orchestrator.slots.operations import message_boundaries


def require_attention(wanted: bool, attention_layers: list[int]) -> None:
    """Refuse (``INVALID_REQUEST``) attention ``wanted`` from a model without attention layers (recurrent)."""
    if wanted and not attention_layers:
        raise ServiceError(ErrorCode.INVALID_REQUEST, "this model has no attention layers (recurrent): no attention")


def check_reduction(cap: CaptureOptions, info: proto.ModelInfo, n_input: int) -> CaptureOptions:
    """``cap`` when its reduction is valid for ``info``'s model and an input of ``n_input`` tokens; raises
    :class:`ServiceError` (``INVALID_REQUEST``) saying why not (:func:`contract.reduction.reduction_error`)."""
    bad = reduction_error(cap, info.num_attention_heads, info.n_ctx, n_input)
    if bad is not None:
        raise ServiceError(ErrorCode.INVALID_REQUEST, bad)
    return cap


def message_spans(ids: list[int], eot: int) -> list[tuple[int, int]]:
    """``[start, end)`` input positions of each chat message of ``ids``: the slot's message boundaries
    (``GET /v1/slots/{id}/info``, each message ending at an ``eot`` token or at the last token)."""
    return [(m["start"], m["end"] + 1) for m in message_boundaries(ids, eot)]


def capture_options(req: CanonicalRequest, info: proto.ModelInfo, ids: list[int]) -> CaptureOptions:
    """Validated capture options of ``req`` generating from ``ids``.

    ``attention_layers``: distinct layers among the model's layers with attention (``GET /api/v1/model``'s
    ``attention_layers``; a recurrent model has none, and asking it for attention is an ``INVALID_REQUEST``).
    Format ``spans`` without ``attention_spans``: one span per chat message of ``ids`` (:func:`message_spans`).
    Raises :class:`ServiceError` (``INVALID_REQUEST``) for any option out of range.
    """
    layers = req.attention_layers
    attention_layers = info.attention_layers
    require_attention(req.attention, attention_layers)
    if layers is not None and (
        not layers or any(il not in attention_layers for il in layers) or len(set(layers)) != len(layers)
    ):
        raise ServiceError(
            ErrorCode.INVALID_REQUEST, f"attention_layers must be distinct layers with attention: {attention_layers}"
        )
    spans = req.attention_spans
    if spans is None and req.attention_format == "spans":
        spans = message_spans(ids, info.eot_token_id)
    cap = CaptureOptions(
        attention=req.attention,
        format=req.attention_format,
        dtype=req.attention_dtype,
        layers=layers,
        hidden_state=req.hidden_state,
        heads=req.attention_heads,
        top_k=req.attention_top_k,
        spans=[(int(a), int(b)) for a, b in spans or []],
        sink=req.attention_sink,
    )
    return check_reduction(cap, info, len(ids))
