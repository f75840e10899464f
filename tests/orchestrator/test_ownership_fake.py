"""One owner per slot, in-process: two nodes (fake engines) on one directory store.

A node's knowledge of a slot comes from the store whenever it takes the slot's lease, and the
store commits a write only from the lease holder (the lease token fences it).  The real-engine,
real-Redis version of these scenarios is tests/orchestrator/test_multinode.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from orchestrator.service_error import ServiceError
from tests.orchestrator.fake_world import PROMPT, FlakyStore, World, greedy, wait_for

REFUSED = "slotserve_stale_writes_refused_total"


def refused_writes() -> float:
    """The process's count of refused stale writes (prometheus-client's default registry)."""
    return REGISTRY.get_sample_value(REFUSED) or 0.0


async def stored_tokens(w: World, slot_id: str) -> list[int]:
    meta = await w.archive.lookup(slot_id)
    assert meta is not None
    return list(meta.tokens)


async def test_a_node_that_was_refused_a_slot_takes_the_stored_state_when_it_gets_the_lease(tmp_path: Path) -> None:
    """Node b asks for a slot before node a's first save: 409.  Once a parks it, b serves it with a's
    state (never empty) and its next write extends a's (the generation only grows)."""
    a = World(tmp_path / "state", node="node-a", write_delay_s=60)  # a's turn is not saved before b asks
    b = World(tmp_path / "state", node="node-b", store=a.store)
    await a.registry.start()
    await b.registry.start()
    try:
        await a.gen("p", PROMPT)
        with pytest.raises(ServiceError) as refused:
            await b.gen("p", PROMPT)
        assert refused.value.code == "SLOT_BUSY"
        assert await a.archive.lookup("p") is None, "the scenario needs a's state unsaved when b asks"
        async with a.registry.use("p", resident=False) as slot:
            await a.registry.residency.park(slot)
        a_tokens = await stored_tokens(a, "p")
        first = await a.archive.lookup("p")
        assert first is not None
        async with b.registry.use("p", resident=False) as slot:
            assert await b.registry.kv.tokens(slot) == a_tokens, "b serves a's state, not an empty slot"
        follow = [*a_tokens, 9]
        done = await b.gen("p", follow, n=3)
        assert done.n_cached == len(a_tokens), "restored from the store, not re-prefilled"
        await b.registry.durability.flush(wait_for_locks=True)
        after = await b.archive.lookup("p")
        assert after is not None and after.generation > first.generation
        assert after.tokens == [*follow, *greedy(follow, 3)], "b's write extends a's state"
    finally:
        await b.registry.shutdown()
        await a.registry.shutdown()


async def test_a_write_from_a_node_past_its_lease_is_refused_and_its_copy_dropped(tmp_path: Path) -> None:
    """Node a stops renewing (a pause longer than its lease); b takes the slot and writes; a's late
    write is refused by the store (counted), a drops its copy, and later serves b's state."""
    a = World(tmp_path / "state", node="node-a", lease_ms=200)  # never started: no heartbeat, no write-behind
    b = World(tmp_path / "state", node="node-b", store=a.store, strict=True)
    await b.registry.start()
    try:
        await a.gen("p", PROMPT)  # dirty in a, not saved: a is "paused" before its write-behind
        while await a.store.lease_owner("p") is not None:  # a lease lapses by time: nothing to wait on
            await asyncio.sleep(0.05)
        b_ids = [*PROMPT, 7, 7]
        await b.gen("p", b_ids, n=2)  # strict: stored before answered
        await b.registry.durability.flush(wait_for_locks=True)  # and its last token (else written behind)
        b_tokens = await stored_tokens(b, "p")
        assert b_tokens == [*b_ids, *greedy(b_ids, 2)]
        before = refused_writes()
        assert await a.registry.durability.flush() == 0  # a wakes up and writes its stale copy: refused
        assert refused_writes() == before + 1
        assert await stored_tokens(b, "p") == b_tokens, "the stale node overwrote nothing"
        slot = a.registry.slots["p"]
        assert not a.registry.is_resident(slot) and not a.leases.holds("p"), "a dropped its copy"
        with pytest.raises(ServiceError) as busy:
            await a.gen("p", PROMPT)
        assert busy.value.code == "SLOT_BUSY" and busy.value.extra["owner"] == "node-b"
        async with b.registry.use("p", resident=False) as held:
            await b.registry.residency.park(held)
        follow = [*b_tokens, 3]
        done = await a.gen("p", follow, n=2)
        assert done.n_cached == len(b_tokens), "a restored b's state, not its own stale one"
        assert a.seq_tokens("p") == [*follow, *greedy(follow, 2)]
    finally:
        await b.registry.shutdown()
        await a.registry.shutdown()


async def test_strict_durability_stores_a_turn_before_answering_it(tmp_path: Path) -> None:
    w = World(tmp_path / "state", strict=True, write_delay_s=60)
    await w.registry.start()
    try:
        ids = list(PROMPT)
        for _ in range(3):
            await w.gen("s", ids, n=2)
            ids = [*ids, *greedy(ids, 2)]
            # all but the last generated token, whose KV the engine writes with the next operation
            assert await stored_tokens(w, "s") == ids[:-1], "answered, hence stored"
            ids.append(5)
    finally:
        await w.registry.shutdown()
    assert await stored_tokens(w, "s") == ids[:-1], "the stop stored the last token too"
    assert w.store.puts["s"] == 4, "one write per turn (the next turn came before the write-behind's), one at the stop"


async def test_write_behind_answers_before_storing(tmp_path: Path) -> None:
    w = World(tmp_path / "state", write_delay_s=60)
    await w.registry.start()
    try:
        await w.gen("s", PROMPT, n=2)
        assert await w.archive.lookup("s") is None, "write-behind: stored later"
        assert w.registry.slots["s"].dirty
    finally:
        await w.registry.shutdown()
    assert await stored_tokens(w, "s") == [*PROMPT, *greedy(PROMPT, 2)], "a graceful stop stores it"


async def test_strict_durability_does_not_answer_a_turn_it_cannot_store(tmp_path: Path) -> None:
    """Under ``strict`` a store outage makes a turn ``STORE_UNAVAILABLE`` instead of an answer a crash
    could lose; the turn's state is kept (dirty) and written once the store is back."""
    store = FlakyStore(tmp_path / "state")
    w = World(tmp_path / "state", store=store, strict=True)
    await w.registry.start()
    try:
        await w.gen("s", PROMPT, n=2)
        store.down = True
        ids = [*PROMPT, *greedy(PROMPT, 2), 6]
        with pytest.raises(ServiceError) as refused:
            await w.gen("s", ids, n=2)
        assert refused.value.code == "STORE_UNAVAILABLE"
        assert w.registry.slots["s"].dirty and w.seq_tokens("s") == [*ids, *greedy(ids, 2)]
        store.down = False
        await wait_for(lambda: not w.registry.slots["s"].dirty, timeout=5)
        await w.archive.settled("s")
        assert await stored_tokens(w, "s") == [*ids, *greedy(ids, 2)]
    finally:
        store.down = False
        await w.registry.shutdown()


async def test_a_lapsed_lease_nobody_took_is_taken_back_for_the_write(tmp_path: Path) -> None:
    """A lease that lapsed while its node held the slot (a store outage or a pause longer than the
    lease) is taken back when no other node took it and the store is unchanged: the turn is kept."""
    a = World(tmp_path / "state", node="node-a", lease_ms=200)  # never started: no heartbeat
    await a.gen("p", PROMPT, n=2)
    await a.registry.durability.flush()
    ids = [*PROMPT, *greedy(PROMPT, 2), 4]
    await a.gen("p", ids, n=2)  # dirty, not yet written
    while await a.store.lease_owner("p") is not None:  # a lease lapses by time: nothing to wait on
        await asyncio.sleep(0.05)
    a.leases.forget("p")  # as the heartbeat does when it finds the lease gone
    before = refused_writes()
    assert await a.registry.durability.flush() == 1
    assert refused_writes() == before, "taken back, not refused"
    assert await stored_tokens(a, "p") == [*ids, *greedy(ids, 2)] and a.leases.holds("p")
    await a.registry.shutdown()


@pytest.mark.parametrize("durability", ["write-behind", "strict"])
async def test_a_write_with_a_lapsed_token_takes_the_lease_back(tmp_path: Path, durability: str) -> None:
    """After an outage longer than the lease the node still holds its old token (the heartbeat has not
    run since the store came back): the store refuses a write with it.  Nobody took the lease and
    the stored version is unchanged, so the node takes the lease back and writes again: write-behind
    keeps the turn, strict answers it (before: dropped, and 409 after the turn was generated)."""
    strict = durability == "strict"
    a = World(tmp_path / "state", node="node-a", lease_ms=200, strict=strict, write_delay_s=60)  # no heartbeat
    await a.gen("p", PROMPT, n=2)
    await a.registry.durability.flush()
    old_token = a.leases.token("p")
    while await a.store.lease_owner("p") is not None:  # the lease lapses (an outage longer than it)
        await asyncio.sleep(0.05)
    ids = [*PROMPT, *greedy(PROMPT, 2), 4]
    await a.gen("p", ids, n=2)  # strict: stored before answered, under the lease taken back
    if strict:  # all but the last generated token, whose KV write is pending (the write-behind's)
        assert await stored_tokens(a, "p") == [*ids, *greedy(ids, 2)][:-1]
    assert await a.registry.durability.flush() == 1
    assert await stored_tokens(a, "p") == [*ids, *greedy(ids, 2)], "the turn is kept"
    assert a.leases.holds("p") and a.leases.token("p") != old_token and a.registry.slots["p"].synced is not None
    await a.registry.shutdown()


async def test_a_lapsed_lease_another_node_took_is_not_taken_back(tmp_path: Path) -> None:
    """The same refusal when another node wrote the slot meanwhile: this node's copy is dropped."""
    a = World(tmp_path / "state", node="node-a", lease_ms=200, write_delay_s=60)
    b = World(tmp_path / "state", node="node-b", store=a.store, lease_ms=200, write_delay_s=60)
    await a.gen("p", PROMPT, n=2)
    await a.registry.durability.flush()
    while await a.store.lease_owner("p") is not None:
        await asyncio.sleep(0.05)
    ids = [*PROMPT, *greedy(PROMPT, 2), 4]
    await b.gen("p", ids, n=2)
    await b.registry.durability.flush()
    await b.registry.shutdown()  # b released the lease: only the stored version tells
    b_tokens = await stored_tokens(b, "p")
    a.registry.kv.changed(a.registry.slots["p"])  # a's old copy, dirty, written with its lapsed token
    before = refused_writes()
    assert await a.registry.durability.flush() == 0, "refused: the store holds b's newer version"
    assert refused_writes() > before and not a.leases.holds("p") and a.registry.slots["p"].synced is None
    assert await stored_tokens(a, "p") == b_tokens, "b's write stands"
    await a.registry.shutdown()
