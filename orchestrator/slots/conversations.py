"""Stored conversations of the Responses API: what ``previous_response_id`` continues.

OpenAI's Responses API (platform.openai.com/docs/api-reference/responses/create) continues a
conversation from ``previous_response_id``.  For each stored response (``store`` true) this keeps
its conversation (its messages in chat shape, without ``instructions``, and the slot it ran on)
in the state store beside the slots (:mod:`storage.records`, the store's time to live), so any
node of a deployment and a restarted node continue it, on the same slot and its KV cache.  A
record belongs to the tenant that made it: its name carries the tenant, so another tenant's
response id is unknown, exactly as a missing one.  Without a store (``--no-persist``) they are
kept in this process's memory only.  The latest :data:`MAX_KEPT` are also kept in memory (the
fast path; without a store, all there is).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
import structlog

from orchestrator.service_error import ServiceError
from orchestrator.slots.persistence import SlotArchive

log = structlog.get_logger("slotserve.conversations")

MAX_KEPT = 1024
"""Conversations kept in this process's memory (least recently used dropped first)."""


class Kept(msgspec.Struct):
    """A stored conversation: the id of the slot it ran on (in its tenant) and its messages (chat
    shape: ``[{"role", "content", "tool_calls"?...}]``)."""

    slot: str
    messages: list[dict[str, Any]]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Kept).decode


def record_name(tenant: str, response_id: str) -> str:
    """The store record of ``tenant``'s response ``response_id``: ``response:<tenant>/<id>``."""
    return f"response:{tenant}/{response_id}"


class StoredConversations:
    """Conversations by (tenant, response id), in ``archive``'s store (None: memory only)."""

    def __init__(self, archive: SlotArchive | None, limit: int = MAX_KEPT) -> None:
        self.archive = archive
        self.limit = limit
        self.recent: OrderedDict[str, Kept] = OrderedDict()

    async def get(self, tenant: str, response_id: str) -> Kept | None:
        """``tenant``'s conversation of ``response_id``, or None (unknown, expired, or another
        tenant's).  ``STORE_UNAVAILABLE`` when the store cannot be asked."""
        name = record_name(tenant, response_id)
        kept = self.recent.get(name)
        if kept is None and self.archive is not None:
            data = await self.archive.get_record(name)
            if data is not None:
                try:
                    kept = _decode(data)
                except msgspec.DecodeError:
                    log.warning("unreadable stored conversation", response_id=response_id)
                    return None
        if kept is not None:
            self._remember(name, kept)
        return kept

    async def put(self, tenant: str, response_id: str, kept: Kept) -> None:
        """Keep ``kept`` as ``tenant``'s response ``response_id``.  A store that fails is logged (the
        answer is given all the same; only another node or a restart then misses it)."""
        name = record_name(tenant, response_id)
        self._remember(name, kept)
        if self.archive is None:
            return
        try:
            await self.archive.put_record(name, _encode(kept))
        except ServiceError as exc:
            log.warning("could not store a conversation", response_id=response_id, error=exc.message)

    def _remember(self, name: str, kept: Kept) -> None:
        self.recent[name] = kept
        self.recent.move_to_end(name)
        while len(self.recent) > self.limit:
            self.recent.popitem(last=False)
