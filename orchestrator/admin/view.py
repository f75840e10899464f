"""The operator's view of the slots: where each one's KV state lives, its size, messages, owner.

Places (``place``):

* ``kv_cache``: the slot holds an engine sequence with its cells in the KV cache;
* ``store``: parked, only in the state store;
* ``leased``: in the store and leased by another node (``owner`` names it);
* ``empty``: known, no state.

Message counts are seed-style boundaries at the end-of-turn token (as
``GET /v1/slots/{id}/info``).  They are read from the worker for resident slots
without taking the slot (reads never make a client's request ``SLOT_BUSY``), and
remembered per token count for slots that are parked later.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from orchestrator.services import Services
from orchestrator.slots.model import slot_id_out, split_key
from orchestrator.slots.operations import SlotOps, message_boundaries
from orchestrator.tenants.principal import DEFAULT_TENANT
from storage.base import state_bytes, stored_bytes


class SlotView(msgspec.Struct, kw_only=True):
    """One slot as the admin page shows it (sizes in bytes; ``last_used`` in unix seconds, so that
    the listing only changes when a slot does)."""

    id: str  # the slot's key: its id, or ``tenant/id`` beyond the default tenant (docs/operations.md)
    place: str
    generating: bool
    n_tokens: int
    n_messages: int | None
    state_bytes: int
    stored_bytes: int
    last_used: float | None
    owner: str | None
    seq: int | None = None
    tenant: str = DEFAULT_TENANT


class AdminView:
    """Builds :class:`SlotView` lists; remembers message counts per (slot, n_tokens)."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.messages: dict[str, tuple[int, int]] = {}  # slot id -> (n_tokens, n_messages)

    def node_id(self) -> str:
        """This node's name in slot leases ('' without a store)."""
        leases = self.services.registry.leases
        return leases.node_id if leases is not None else ""

    async def slots(self) -> list[SlotView]:
        """Every slot this node knows or the store holds, sorted by id."""
        s = self.services
        reg = s.registry
        eot = s.generation.info.eot_token_id
        node = self.node_id()
        out: dict[str, SlotView] = {}
        if s.archive is not None:
            for meta in await s.archive.list_stored():
                owner = None
                if reg.leases is not None and not reg.leases.holds(meta.slot_id):
                    owner = await reg.leases.owner(meta.slot_id)
                out[meta.slot_id] = SlotView(
                    id=meta.slot_id,
                    tenant=split_key(meta.slot_id)[0],
                    place="leased" if owner and owner != node else "store",
                    generating=False,
                    n_tokens=meta.n_tokens,
                    n_messages=self._known_messages(meta.slot_id, meta.n_tokens),
                    state_bytes=state_bytes(meta),
                    stored_bytes=stored_bytes(meta),
                    last_used=round(meta.updated_at, 1),
                    owner=owner or None,
                )
        for slot in list(reg.slots.values()):
            resident = reg.is_resident(slot)
            if not resident and slot.key in out:
                continue
            view = out.get(slot.key)
            n_tokens = slot.n_tokens
            n_messages = self._known_messages(slot.key, n_tokens)
            if resident and not slot.busy:
                tokens = await reg.kv.tokens(slot)
                n_tokens, n_messages = len(tokens), len(message_boundaries(tokens, eot))
                self.messages[slot.key] = (n_tokens, n_messages)
            place = "kv_cache" if resident else slot.place
            out[slot.key] = SlotView(
                id=slot.key,
                tenant=slot.tenant,
                place="store" if place == "parked" else place,
                generating=slot.busy,
                n_tokens=n_tokens,
                n_messages=n_messages,
                state_bytes=slot.raw_bytes or (view.state_bytes if view else 0),
                stored_bytes=slot.stored_bytes or (view.stored_bytes if view else 0),
                last_used=round(time.time() - (time.monotonic() - slot.last_used), 1),
                owner=node or None,
                seq=slot.seq if resident else None,
            )
        return [out[k] for k in sorted(out)]

    def _known_messages(self, slot_id: str, n_tokens: int) -> int | None:
        known = self.messages.get(slot_id)
        return known[1] if known is not None and known[0] == n_tokens else None

    async def messages_of(self, slot_id: str) -> dict[str, Any]:
        """A slot's messages as text with their token ranges (holds the slot briefly; ``SLOT_BUSY``
        while it generates, ``SLOT_NOT_FOUND`` for an unknown id).  ``slot_id`` is the slot's key
        (:attr:`SlotView.id`): the admin page sees every tenant's slots."""
        s = self.services
        eot = s.generation.info.eot_token_id
        tenant, bare_id = split_key(slot_id)
        async with s.registry.use(bare_id, tenant=tenant, create=False, resident=False) as slot:
            tokens = await SlotOps(s.registry, s.settings.slot_save_path).tokens(slot)
        bounds = message_boundaries(tokens, eot)
        self.messages[slot_id] = (len(tokens), len(bounds))
        texts = [await s.engine.detokenize(tokens[b["start"] : b["end"] + 1]) for b in bounds]
        return {
            "id_slot": slot_id_out(slot_id),
            "n_tokens": len(tokens),
            "boundary_eot": eot,
            "messages": [{**b, "text": t} for b, t in zip(bounds, texts, strict=True)],
        }
