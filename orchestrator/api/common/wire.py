"""Wire types every API surface shares: a token's text, its attention (slotserve's extension,
docs/api.md "Attention"), a context shift, prompt progress (llama-server's ``prompt_progress``) and a
slot's message spans (``/v1/slots/{id}/info``, the admin page)."""

from __future__ import annotations

import base64

import msgspec
from msgspec import UNSET, UnsetType

from contract.options import GRAPH_FORMATS
from orchestrator.generation.events import TokenOut


class TokenText(msgspec.Struct, kw_only=True):
    """A token and its text; ``bytes`` (the raw piece) when the piece alone is not valid UTF-8."""

    token_id: int
    text: str
    bytes_: list[int] | UnsetType = msgspec.field(default=UNSET, name="bytes")


class ContextShift(msgspec.Struct, kw_only=True):
    """A context shift before this token (``--context-shift``; docs/api.md, "Context shift"): the slot's
    tokens ``n_keep .. n_keep+n_discard-1`` were dropped and the later ones moved down, so from this
    token on, attention position ``p >= n_keep`` is the earlier tokens' ``p + n_discard``."""

    n_keep: int
    n_discard: int


class Attention(msgspec.Struct, kw_only=True):
    """One token's attention (docs/api.md, "Attention" and "Attention formats"): ``shape``
    ``[n_layers, n_heads, context_length]`` (``per_layer``), ``[context_length]`` (``aggregated``),
    ``[n_layers, n_heads, k]`` (``topk``, ``k = min(attention_top_k, context_length)``) or ``[n_spans]``
    (``spans``); ``data`` base64 of ``dtype`` values; ``positions`` (``topk``) base64 of ``int32`` input
    positions of ``shape``; ``sink`` (``attention_sink``) the mass on the first positions;
    ``context_shift`` on the first row after a context shift."""

    format: str
    shape: list[int]
    context_length: int
    encoding: str
    dtype: str
    data: str
    context_shift: ContextShift | UnsetType = UNSET
    positions: str | UnsetType = UNSET
    sink: float | UnsetType = UNSET


def context_shift_of(t: TokenOut) -> ContextShift | UnsetType:
    """The :class:`ContextShift` before ``t``, if one came."""
    return UNSET if t.shift is None else ContextShift(n_keep=t.shift[0], n_discard=t.shift[1])


def token_text(t: TokenOut) -> TokenText:
    """:class:`TokenText` of a generated token: ``bytes`` only when its piece alone is not valid UTF-8."""
    try:
        t.piece.decode("utf-8")
    except UnicodeDecodeError:
        return TokenText(token_id=t.token_id, text=t.text, bytes_=list(t.piece))
    return TokenText(token_id=t.token_id, text=t.text)


def attention_of(t: TokenOut, fmt: str, dtype: str) -> Attention | None:
    """The attention object of the JSON and SSE APIs (docs/api.md, "Attention"): ``t.attention``, the
    worker's little-endian ``dtype`` bytes of ``t.attention_shape``, base64-encoded (and ``topk``'s ``int32``
    positions, the ``sink`` figure); ``None`` without."""
    if t.attention is None:
        return None
    data = base64.b64encode(t.attention).decode("ascii")
    shape = t.attention_shape
    rows = fmt in GRAPH_FORMATS  # full rows: their last axis is the context
    return Attention(
        format=fmt, shape=shape, context_length=shape[-1] if rows else t.context_length, encoding="base64",
        dtype=dtype, data=data, context_shift=context_shift_of(t),
        positions=UNSET if t.positions is None else base64.b64encode(t.positions).decode("ascii"),
        sink=UNSET if t.sink is None else t.sink,
    )  # fmt: skip


class MessageSpan(msgspec.Struct, kw_only=True):
    """A message's token range, ``start``..``end`` inclusive (``index`` from 0)."""

    index: int
    start: int
    end: int


class SlotMessage(MessageSpan, kw_only=True):
    """A message of a slot with its text."""

    text: str


class SlotMessages(msgspec.Struct, kw_only=True):
    """``GET /admin/api/slots/{id}/messages``: a slot's messages as text with token ranges."""

    id_slot: int | str
    n_tokens: int
    boundary_eot: int
    messages: list[SlotMessage]


class PromptProgress(msgspec.Struct, kw_only=True):
    """llama-server's ``prompt_progress`` (``return_progress``): ``processed`` of ``total`` prompt tokens
    are in the KV cache, ``cache`` of them reused, after ``time_ms`` milliseconds."""

    total: int
    cache: int
    processed: int
    time_ms: float
