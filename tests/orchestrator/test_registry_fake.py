"""The slot registry and generation service in-process, against the fake engine and a real directory store.

Each test builds a :class:`tests.orchestrator.fake_world.World` (one node: fake engine, directory
store in a temporary directory, archive, lease keeper, registry, generation service).  No
llama.cpp, no worker, no HTTP: the whole file runs in seconds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contract import protocol as proto
from contract.options import CaptureOptions, SamplingParams
from orchestrator.engine_client.interface import GenerationJob
from orchestrator.generation.events import DoneOut, TokenOut
from orchestrator.generation.service import RunControl
from orchestrator.service_error import ServiceError
from orchestrator.tenants.principal import DEFAULT_TENANT
from orchestrator.web.errors import from_exception
from tests.orchestrator.fake_engine import FakeEngine, state_blob
from tests.orchestrator.fake_world import PROMPT, FlakyStore, World, greedy, request, saved, wait_for


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path / "state")
    await w.registry.start()
    yield w
    await w.registry.shutdown()


# ---------------------------------------------------------------------------------------------- eviction


async def test_eviction_parks_the_least_recently_used_idle_slot(world: World) -> None:
    reg, eng = world.registry, world.engine
    await world.gen("a", PROMPT)
    await world.gen("b", [*PROMPT, 1])
    a_tokens = list(world.seq_tokens("a"))
    async with reg.use("b"):
        pass  # b is now more recently used than a
    eng.calls.clear()
    await world.gen("c", [*PROMPT, 2])  # two sequences: a (least recently used) is parked for c
    assert [reg.slots[s].place for s in "abc"] == ["parked", "resident", "resident"]
    a = reg.slots["a"]
    assert a.stored and not a.dirty and a.n_tokens == len(a_tokens)
    assert reg.slots["c"].seq == 0, "c took a's sequence"
    # a was saved (or already clean), then its cells erased before c's generation used the sequence
    ops = [op for op, seq in eng.calls if seq == 0]
    assert ops.index("erase") < ops.index("generate")
    assert not world.leases.holds("a") and world.leases.holds("c"), "a parked slot's lease is released"
    meta = await world.archive.lookup("a")
    assert meta is not None and meta.tokens == a_tokens


async def put(w: World, name: str, tokens: list[int], tenant: str = DEFAULT_TENANT) -> int:
    """Restore ``tokens`` into ``tenant``'s slot ``name`` (made if new); the sequence it took."""
    created = w.registry.find(name, tenant) is None
    async with w.registry.use(name, tenant=tenant, resident=False) as slot:
        await w.registry.kv.restore(slot, tokens, state_blob(tokens), created=created)
        assert slot.seq is not None
        return slot.seq


async def test_a_free_sequence_is_taken_freed_last_first(tmp_path: Path) -> None:
    """Of several free sequences a restore takes the one a park or an erase emptied last (its KV stream
    is still resident in the worker, engine/kv_release.py), not the lowest; never-held ones lowest first.
    The slot parked to free it, another tenant's, comes back from the store intact."""
    w = World(tmp_path / "state", n_seqs=4)
    await w.registry.start()
    reg = w.registry
    try:
        assert [
            await put(w, name, [*PROMPT, i], "alice" if name == "c" else DEFAULT_TENANT)
            for i, name in enumerate("abcd")
        ] == [0, 1, 2, 3], "never-held sequences: lowest first"
        async with reg.use("a", resident=False) as a:  # emptied first
            await reg.forget(a)
        async with reg.use("c", tenant="alice", resident=False) as c:  # parked last
            await reg.residency.park(c)
        assert reg.residency.owner[0] is None and reg.residency.owner[2] is None
        assert await put(w, "x", [5, 6], "bob") == 2, "the sequence freed last (alice's parked slot's), not 0"
        assert w.engine.seqs[2] == [5, 6], "bob's restore replaced every cell"
        assert await put(w, "y", [7]) == 0
        async with reg.use("x", tenant="bob", resident=False) as x:
            await reg.forget(x)
        async with reg.use("c", tenant="alice") as c:  # alice's slot back from the store, into 2 again
            assert c.seq == 2 and w.engine.seqs[2] == [*PROMPT, 2]
    finally:
        await reg.shutdown()


async def test_park_idle_parks_only_slots_idle_long_enough(world: World) -> None:
    reg = world.registry
    await world.gen("old", PROMPT)
    await world.gen("new", PROMPT)
    old, new = reg.slots["old"].last_used, reg.slots["new"].last_used
    assert old < new
    # idle longer than "new", shorter than "old" (park_idle reads the clock before its first await)
    assert await reg.residency.park_idle(time.monotonic() - (old + new) / 2) == 1
    assert reg.slots["old"].place == "parked" and reg.slots["new"].place == "resident"
    assert await reg.residency.park_idle(0.0) == 1
    assert reg.slots["new"].place == "parked"
    assert world.leases.leases == {}


async def test_a_slots_own_keep_alive_wins_over_park_idle(tmp_path: Path) -> None:
    """Ollama's ``keep_alive`` per slot (:meth:`SlotRegistry.keep_alive`): ``inf`` is never parked for being
    idle, 0 at once even when the server parks nothing (``park_idle(None)``), None follows ``park_idle``."""
    world = World(tmp_path / "state", n_seqs=3)
    reg = world.registry
    await reg.start()
    try:
        for name in ("forever", "now", "default"):
            await world.gen(name, PROMPT)
        reg.keep_alive(reg.slots["forever"], float("inf"))
        reg.keep_alive(reg.slots["now"], 0.0)
        assert await reg.residency.park_idle(None) == 1
        assert [reg.slots[s].place for s in ("forever", "now", "default")] == ["resident", "parked", "resident"]
        assert await reg.residency.park_idle(0.0) == 1
        assert [reg.slots[s].place for s in ("forever", "default")] == ["resident", "parked"]
    finally:
        await reg.shutdown()


async def test_the_registry_parks_idle_slots_by_itself(tmp_path: Path) -> None:
    w = World(tmp_path / "state", park_idle_s=0.3)
    await w.registry.start()
    try:
        await w.gen("idle", PROMPT)
        slot = w.registry.slots["idle"]
        assert slot.place == "resident" and w.leases.holds("idle")
        await wait_for(lambda: slot.place == "parked")
        assert slot.stored and not w.leases.holds("idle"), "parked: stored, lease released for other nodes"
        assert w.engine.seqs[0] == [], "its cells are erased"
    finally:
        await w.registry.shutdown()


async def test_a_parked_slot_is_restored_not_reprefilled(world: World) -> None:
    reg = world.registry
    t1 = await world.gen("p", PROMPT, n=5)
    follow = [*world.seq_tokens("p"), 7, 9]
    async with reg.use("p", resident=False) as slot:
        await reg.residency.park(slot)
    assert slot.place == "parked" and slot.seq is None
    world.engine.calls.clear()
    t2 = await world.gen("p", follow, n=5)
    assert world.engine.count("restore") == 1
    assert t2.n_cached == len(follow) - 2, "the restored state is reused, only the new tokens prefilled"
    assert world.seq_tokens("p") == follow + greedy(follow, 5)
    assert t1.finish_reason == t2.finish_reason == "length"


async def test_after_a_worker_restart_slots_come_back_from_the_store(world: World) -> None:
    reg, eng = world.registry, world.engine
    await world.gen("r", PROMPT)
    expect = list(world.seq_tokens("r"))
    await saved(world, "r")
    eng.on_restart = lambda: asyncio.sleep(0, reg.residency.on_engine_restart())  # type: ignore[func-returns-value]
    await eng.restart()
    assert not reg.is_resident(reg.slots["r"])
    async with reg.use("r") as slot:
        assert eng.seqs[slot.seq] == expect  # type: ignore[index]


async def test_a_queued_request_gets_the_sequence_of_the_next_slot_to_finish(tmp_path: Path) -> None:
    w = World(tmp_path / "state", n_seqs=1, step_s=0.01)
    await w.registry.start()
    try:
        first = asyncio.create_task(w.gen("one", PROMPT, n=20))
        await wait_for(lambda: bool(w.engine.generating))
        positions: list[int] = []

        async def on_queued(position: int) -> None:
            positions.append(position)

        second = await w.gen("two", PROMPT, n=2, control=RunControl(on_queued))
        assert first.done() and (await first).n_generated == 20, "the first ran to its end"
        assert positions == [1], "the second waited first in line"
        one = w.registry.slots["one"]
        assert one.place == "parked" and one.stored, "the finishing slot was parked for the queued one"
        assert w.registry.slots["two"].place == "resident" and second.n_generated == 2
        meta = await w.archive.lookup("one")
        assert meta is not None and meta.tokens == PROMPT + greedy(PROMPT, 20)
    finally:
        await w.registry.shutdown()


# ---------------------------------------------------------------------------------------------- write-behind


async def test_write_behind_coalesces_a_burst_into_one_save(tmp_path: Path) -> None:
    w = World(tmp_path / "state", write_delay_s=0.3)
    await w.registry.start()
    try:
        ids = list(PROMPT)
        for _ in range(5):
            await w.gen("burst", ids, n=2)
            ids = [*w.seq_tokens("burst"), 3]
        assert w.store.puts.get("burst", 0) == 0, "nothing written during the burst"
        await wait_for(lambda: w.store.puts.get("burst", 0) >= 1)
        await asyncio.sleep(0.4)  # a second save would come by now
        assert w.store.puts["burst"] == 1
        assert w.engine.count("read_kv") == 1, "one read of the state from the engine"
        meta = await w.archive.lookup("burst")
        assert meta is not None and meta.tokens == w.seq_tokens("burst")
        assert not w.registry.slots["burst"].dirty
    finally:
        await w.registry.shutdown()


async def test_shutdown_flushes_dirty_slots(tmp_path: Path) -> None:
    w = World(tmp_path / "state", write_delay_s=60)
    await w.registry.start()
    await w.gen("s", PROMPT)
    expect = list(w.seq_tokens("s"))
    assert w.store.puts.get("s", 0) == 0
    await w.registry.shutdown()
    assert w.store.puts["s"] == 1
    got = await w.archive.load("s")
    assert got is not None and got[0].tokens == expect


# ---------------------------------------------------------------------------------------------- busy slots


async def test_a_busy_slot_refuses_a_second_request_and_a_waiter_gets_it_after(tmp_path: Path) -> None:
    w = World(tmp_path / "state", step_s=0.02)
    await w.registry.start()
    try:
        first = asyncio.create_task(w.gen("busy", PROMPT, n=10))
        await wait_for(lambda: w.registry.slots.get("busy") is not None and w.registry.slots["busy"].busy)
        with pytest.raises(ServiceError) as refused:
            await w.gen("busy", PROMPT)
        assert refused.value.code == "SLOT_BUSY" and from_exception(refused.value).status == 409
        assert refused.value.extra["slot_id"] == "busy"
        second = await w.gen("busy", PROMPT, n=2, wait=True)  # waits for the first
        assert first.done()
        assert (await first).n_generated == 10
        assert second.n_cached == len(PROMPT) - 1
    finally:
        await w.registry.shutdown()


async def test_a_slot_leased_by_another_node_is_refused_with_owner_and_retry_after(tmp_path: Path) -> None:
    a = World(tmp_path / "state", node="node-a")
    b = World(tmp_path / "state", node="node-b", store=a.store)  # one store, as two nodes on one Redis
    await a.registry.start()
    await b.registry.start()
    try:
        await a.gen("shared", PROMPT)
        with pytest.raises(ServiceError) as refused:
            await b.gen("shared", PROMPT)
        err = refused.value
        assert err.code == "SLOT_BUSY" and err.extra["owner"] == "node-a" and err.extra["retry_after"] >= 1
        assert not b.registry.slots["shared"].busy, "the refused request left nothing held"
        async with a.registry.use("shared", resident=False) as slot:
            await a.registry.residency.park(slot)  # parking hands the conversation on
        done = await b.gen("shared", a_tokens := [*a.engine.seqs[0], 4], n=3)
        assert done.n_cached == len(a_tokens) - 1, "node b restored node a's state"
    finally:
        await b.registry.shutdown()
        await a.registry.shutdown()


# ---------------------------------------------------------------------------------------------- cancel


async def test_a_generation_cancelled_midway_leaves_the_slot_consistent(tmp_path: Path) -> None:
    w = World(tmp_path / "state", step_s=0.01)
    await w.registry.start()
    try:
        control = RunControl()
        seen: list[TokenOut] = []
        done = None
        async for ev in w.service.run(request("c", PROMPT, 50), control):
            if isinstance(ev, TokenOut):
                seen.append(ev)
                if len(seen) == 3:
                    await control.cancel()
            elif isinstance(ev, DoneOut):
                done = ev
        assert done is not None and done.finish_reason == "cancelled"
        slot = w.registry.slots["c"]
        assert not slot.busy and not slot.lock.locked()
        assert slot.n_tokens == len(w.seq_tokens("c")) == done.seq_tokens
        assert w.seq_tokens("c") == PROMPT + greedy(PROMPT, len(w.seq_tokens("c")) - len(PROMPT))
        await saved(w, "c")
        meta = await w.archive.lookup("c")
        assert meta is not None and meta.tokens == w.seq_tokens("c")
        nxt = await w.gen("c", [*w.seq_tokens("c"), 1], n=2)  # the slot serves the next turn
        assert nxt.finish_reason == "length"
    finally:
        await w.registry.shutdown()


async def test_a_client_leaving_midway_leaves_the_slot_consistent(world: World) -> None:
    world.engine.step_s = 0.01
    stream = world.service.run(request("gone", PROMPT, 50))
    n = 0
    async for ev in stream:
        if isinstance(ev, TokenOut):
            n += 1
            if n == 2:
                break
    await stream.aclose()  # type: ignore[attr-defined]
    slot = world.registry.slots["gone"]
    assert not slot.busy and not slot.lock.locked()
    assert slot.n_tokens == len(PROMPT) + 2 == len(world.seq_tokens("gone"))
    await saved(world, "gone")
    meta = await world.archive.lookup("gone")
    assert meta is not None and meta.tokens == world.seq_tokens("gone")


# ---------------------------------------------------------------------------------------------- slot actions


async def test_a_refused_restore_leaves_the_slot_as_it_was(world: World) -> None:
    reg = world.registry
    await world.gen("k", PROMPT)
    before = list(world.seq_tokens("k"))
    async with reg.use("k", resident=False) as slot:
        with pytest.raises(Exception, match="state"):
            await reg.kv.restore(slot, [1, 2, 3], state_blob([1, 2]), created=False)
    assert world.seq_tokens("k") == before and reg.slots["k"].n_tokens == len(before)
    async with reg.use("new", resident=False) as fresh:
        with pytest.raises(Exception, match="state"):
            await reg.kv.restore(fresh, [1, 2, 3], state_blob([9]), created=True)
    assert "new" not in reg.slots and reg.residency.owner.count(None) == 1, "the created slot and its sequence are gone"


async def test_fork_copies_and_restore_state_replaces(world: World) -> None:
    reg = world.registry
    await world.gen("src", PROMPT)
    src_tokens = list(world.seq_tokens("src"))
    async with reg.use("src", resident=False) as src, reg.use("dst", resident=False) as dst:
        assert await reg.kv.fork(src, dst) == len(src_tokens)
    assert world.seq_tokens("dst") == src_tokens
    async with reg.kv.lend_state(reg.slots["src"]) as got:
        assert got is not None and (got.tokens, bytes(got.state)) == (src_tokens, state_blob(src_tokens))
    async with reg.use("dst", resident=False) as dst:
        await reg.kv.restore(dst, [1, 2], state_blob([1, 2]), created=False)
    assert world.seq_tokens("dst") == [1, 2] and reg.slots["dst"].n_tokens == 2
    await saved(world, "dst")
    meta = await world.archive.lookup("dst")
    assert meta is not None and meta.tokens == [1, 2]


async def test_the_fake_generates_what_greedy_predicts_and_refuses_a_busy_sequence() -> None:
    eng = FakeEngine(1)
    params = SamplingParams(max_new_tokens=3)
    stream = await eng.generate(GenerationJob(seq=0, input_ids=PROMPT, params=params, capture=CaptureOptions()))
    with pytest.raises(Exception, match="generating"):
        await eng.erase(0)
    events = [ev async for ev in stream]
    assert [ev.token.token_id for ev in events[:-1]] == greedy(PROMPT, 3)  # type: ignore[attr-defined]
    assert isinstance(events[-1], proto.Done) and events[-1].seq_tokens == len(PROMPT) + 3
    await eng.erase(0)  # free again once the stream ended
    assert eng.seqs[0] == []


def test_the_fake_has_every_method_of_the_engine_protocol() -> None:
    """Once ``orchestrator/engine_client/interface.py`` (the typed engine interface) is in the tree, the fake must
    offer each of its members with the same parameters."""
    engine_api = pytest.importorskip("orchestrator.engine_client.interface")
    proto_cls = engine_api.EngineClient
    members = [m for m in dir(proto_cls) if not m.startswith("_")] + list(proto_cls.__annotations__)
    assert {"generate", "save_state", "restore_state", "fork", "generation"} <= set(members)
    fake = FakeEngine(1)
    for name in members:
        assert hasattr(fake, name), f"FakeEngine lacks {name}"
        want = getattr(proto_cls, name, None)
        if inspect.iscoroutinefunction(want):
            got = list(inspect.signature(getattr(fake, name)).parameters)
            assert got == list(inspect.signature(want).parameters)[1:], f"FakeEngine.{name} parameters differ"


# ---------------------------------------------------------------------------------------------- store failures


async def test_a_store_outage_is_one_clear_error_and_the_write_behind_catches_up(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path / "state")
    w = World(tmp_path / "state", store=store)
    await w.registry.start()
    try:
        await w.gen("up", PROMPT)
        await saved(w, "up")
        store.down = True
        done = await w.gen("up", [*w.seq_tokens("up"), 6], n=3)  # resident, lease held: it still generates
        assert done.n_generated == 3
        with pytest.raises(ServiceError) as refused:
            await w.gen("elsewhere", PROMPT)  # needs the store (is it stored? its lease?)
        assert refused.value.code == "STORE_UNAVAILABLE" and from_exception(refused.value).status == 503
        await asyncio.sleep(0.3)
        assert w.registry.slots["up"].dirty and store.puts["up"] == 1, "the save waits for the store"
        assert not w.archive.healthy
        store.down = False
        await wait_for(lambda: store.puts["up"] == 2, timeout=5)
        await w.archive.settled("up")
        meta = await w.archive.lookup("up")
        assert meta is not None and meta.tokens == w.seq_tokens("up") and w.archive.healthy
    finally:
        store.down = False
        await w.registry.shutdown()
