"""Slot leases: with several nodes on one store, a conversation is served by one node at a time.

A lease is the store's ``SET NX PX`` key with a token-checked renew and release
(:mod:`storage.leases`, :class:`storage.redis_store.RedisStore`): :class:`LeaseKeeper` claims
it when a request takes a slot, renews every held lease by a heartbeat every third of its
time-to-live (``--lease-ms``), and releases it when the slot is parked or the node stops.  A
crashed node renews nothing, so its leases lapse within one TTL and any node can then take its
conversations from the store.  The node id (``--node-id``, default ``host:port``) is stable
across restarts, so a restarted node takes its own leases back at once.

The lease token is also the fencing token of the node's writes (:meth:`LeaseKeeper.token`):
the store commits a slot's state only while the writer's token holds its lease, so a node
that lost its lease (a pause longer than the lease, a partition) cannot overwrite what the
new owner wrote.  :meth:`LeaseKeeper.claim` says when a lease is newly taken: the registry
then reads what it knows of the slot from the store again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid

import structlog

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError
from orchestrator.slots.persistence import SlotArchive, refused_write

log = structlog.get_logger("slotserve.leases")


class LeaseKeeper:
    """This node's leases on slots in ``archive``'s store (see module docstring).

    ``lease_ms``: time-to-live of a lease in milliseconds; :attr:`leases` maps the ids of
    the slots this node holds to their lease tokens.
    """

    def __init__(self, archive: SlotArchive, node_id: str, lease_ms: int) -> None:
        self.archive = archive
        self.node_id = node_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_ms = lease_ms
        self.leases: dict[str, str] = {}
        self._heartbeat: asyncio.Task[None] | None = None

    def holds(self, slot_id: str) -> bool:
        """True while this node holds ``slot_id``'s lease."""
        return slot_id in self.leases

    async def claim(self, slot_id: str) -> bool:
        """Hold ``slot_id``'s lease (acquired once, then renewed by the heartbeat); True when it
        was taken now (this node did not hold it: what it saw of the slot may be stale).

        Raises ``SLOT_BUSY`` with ``owner`` (the holder's node id) and ``retry_after`` (the
        lease TTL in seconds, rounded up: by then a dead owner's lease has lapsed) when
        another node holds it; ``STORE_UNAVAILABLE`` when the store cannot be asked.
        """
        if slot_id in self.leases:
            return False
        token = await self.archive.acquire_lease(slot_id, self.node_id, self.lease_ms)
        if token is None:
            owner = await self.archive.lease_owner(slot_id)
            raise ServiceError(
                ErrorCode.SLOT_BUSY,
                f"slot {slot_id!r} is owned by node {owner!r}",
                slot_id=slot_id,
                owner=owner,
                retry_after=max(1, -(-self.lease_ms // 1000)),
            )
        self.leases[slot_id] = token
        return True

    def token(self, slot_id: str) -> str:
        """The lease token fencing this node's writes of ``slot_id``; :class:`OwnershipLost` (logged
        and counted as a refused write) when this node no longer holds the lease."""
        token = self.leases.get(slot_id)
        if token is None:
            raise refused_write(slot_id, "this node lost its lease before the write")
        return token

    def forget(self, slot_id: str) -> None:
        """Drop ``slot_id``'s lease from this node's table without asking the store (the store
        refused a write with it: it is not ours any more)."""
        self.leases.pop(slot_id, None)

    async def release(self, slot_id: str) -> None:
        """Give up ``slot_id``'s lease (a store failure is ignored: the lease then lapses)."""
        token = self.leases.pop(slot_id, None)
        if token is not None:
            with contextlib.suppress(ServiceError):
                await self.archive.release_lease(slot_id, token)

    async def owner(self, slot_id: str) -> str | None:
        """The node holding ``slot_id``'s lease (this node's id for its own), or None."""
        if slot_id in self.leases:
            return self.node_id
        return await self.archive.lease_owner(slot_id)

    def start(self) -> None:
        """Start the heartbeat (call from the event loop)."""
        self._heartbeat = asyncio.create_task(self._renew(), name="lease-heartbeat")

    async def stop(self) -> None:
        """Stop the heartbeat and release every lease (a graceful stop hands conversations on at once)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        for slot_id in list(self.leases):
            await self.release(slot_id)

    async def renew_all(self) -> None:
        """Renew every held lease once; a lease found lost is dropped (the next claim asks again)."""
        for slot_id, token in list(self.leases.items()):
            try:
                renewed = await self.archive.renew_lease(slot_id, token, self.lease_ms)
            except ServiceError:
                return  # the store is down: try again at the next beat
            if not renewed:
                log.warning("lost lease", slot_id=slot_id)
                self.leases.pop(slot_id, None)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            await self.renew_all()
