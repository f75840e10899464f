"""The store contract's leases, run against every implementation (directory, Redis, Redis Cluster, Redis behind
Sentinel): a slot's lease acquired, renewed, released and expired per owner, and writes fenced by a lease
token that commit only while the token holds the lease."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from storage.base import SlotStore
from storage.errors import LeaseLostError
from tests.storage.store_records import blob_for, meta_for
from tests.waiting import async_wait_until

if TYPE_CHECKING:
    from conftest import StoreHarness

pytestmark = pytest.mark.asyncio


async def no_owner(store: SlotStore, slot_id: str) -> bool:
    return await store.lease_owner(slot_id) is None


async def test_leases(harness: StoreHarness) -> None:
    node_a, node_b = harness.make(), harness.make()
    token_a = await node_a.acquire_lease("s", "node#A", 5000)
    assert token_a is not None
    assert await node_b.lease_owner("s") == "node#A"
    assert await node_b.acquire_lease("s", "node-B", 5000) is None
    assert await node_a.acquire_lease("s", "node#A", 5000) == token_a  # re-entrant for the same owner
    assert await node_b.renew_lease("s", "node#A#forged", 5000) is False
    assert await node_b.release_lease("s", "node-B#00") is False
    assert await node_a.renew_lease("s", token_a, 5000) is True
    assert await node_a.release_lease("s", token_a) is True
    assert await node_a.lease_owner("s") is None
    assert await node_a.release_lease("s", token_a) is False
    token_b = await node_b.acquire_lease("s", "node-B", 1000)
    assert token_b is not None and token_b != token_a
    assert await node_a.lease_owner("s") == "node-B"
    assert await node_a.acquire_lease("other-slot", "node#A", 5000) is not None  # leases are per slot
    await async_wait_until(lambda: no_owner(node_a, "s"), "node-B's lease expires")
    assert await node_b.renew_lease("s", token_b, 5000) is False
    assert await node_a.acquire_lease("s", "node#A", 5000) is not None
    with pytest.raises(ValueError):
        await node_a.acquire_lease("s", "node#A", 0)


async def test_writes_fenced_by_a_lease_commit_only_for_its_holder(harness: StoreHarness) -> None:
    """A put or delete with ``lease=token`` commits only while that token holds the slot's lease,
    checked in the same atomic step; a refused one leaves everything as it was (no temporary data)."""
    node_a, node_b = harness.make(chunk_size=1000), harness.make(chunk_size=1000)
    token_a = await node_a.acquire_lease("f", "node-a", 300)
    assert token_a is not None
    first = await node_a.put(meta_for("f", blob_for(1), 1), blob_for(1), lease=token_a)
    with pytest.raises(LeaseLostError):  # a token that never held the lease
        await node_b.put(meta_for("f", blob_for(2), 2), blob_for(2), lease="node-b#" + "0" * 32)
    await asyncio.sleep(0.4)  # node a "pauses" past its lease
    token_b = await node_b.acquire_lease("f", "node-b", 5000)
    assert token_b is not None
    second = await node_b.put(meta_for("f", blob_for(3), 3), blob_for(3), lease=token_b)
    assert second.generation == first.generation + 1
    with pytest.raises(LeaseLostError):  # node a wakes up and writes its stale state
        await node_a.put(meta_for("f", blob_for(4), 4), blob_for(4), lease=token_a)
    with pytest.raises(LeaseLostError):
        await node_a.delete("f", lease=token_a)
    assert await node_a.get("f") == (second, blob_for(3)), "the stale writer changed nothing"
    if harness.is_redis:
        assert await harness.artifacts(node_a, "f") == {"meta"} | {f"blob:2:{i}" for i in range(second.n_chunks)}
    assert await node_b.release_lease("f", token_b)
    with pytest.raises(LeaseLostError):  # no lease at all: not the holder either
        await node_b.put(meta_for("f", blob_for(5), 5), blob_for(5), lease=token_b)
    unfenced = await node_a.put(meta_for("f", blob_for(6), 6), blob_for(6))  # no lease given: unfenced
    assert unfenced.generation == second.generation + 1
    token_b = await node_b.acquire_lease("f", "node-b", 5000)
    assert token_b is not None and await node_b.delete("f", lease=token_b) is True
    assert await node_b.get("f") is None
