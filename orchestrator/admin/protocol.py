"""The admin page's stream events (``GET /admin/events``, server-sent events; see :mod:`orchestrator.admin.routes`).

msgspec Structs, told apart by ``type``; an error is :class:`orchestrator.web.errors.ErrorEvent`.
"""

from __future__ import annotations

import base64

import msgspec

from orchestrator.admin.view import SlotView
from orchestrator.generation.feed import AttentionRow


class SlotsEvent(msgspec.Struct, kw_only=True, tag="slots", tag_field="type"):
    """The slot listing (sent when it changed) and the node that serves the page."""

    node: str
    slots: list[SlotView]


class AttentionEvent(msgspec.Struct, kw_only=True, tag="attention", tag_field="type"):
    """One generated token's attention row: ``data`` is base64 little-endian ``float32[n_ctx]``, the mean
    over every layer and head, or over the heads of ``layer`` (``?layer=N``; null for the mean)."""

    slot_id: str
    index: int
    text: str
    layer: int | None
    n_ctx: int
    data: str

    @classmethod
    def of(cls, row: AttentionRow) -> AttentionEvent:
        """The event of a row the feed published."""
        data = base64.b64encode(row.values.astype("<f4").tobytes()).decode("ascii")
        return cls(
            slot_id=row.slot_id,
            index=row.index,
            text=row.text,
            layer=row.layer,
            n_ctx=int(row.values.shape[0]),
            data=data,
        )
