"""``--anon-slots``: making room for a new anonymous slot deletes the tenant's least recently used idle
one, also while a park or a background save holds that slot's lock (the deletion waits for it), on the
in-process node of :mod:`tests.orchestrator.fake_world` (fake engine, real directory store).

Over HTTP with the real engine: ``test_anonymous_slots.py::test_anonymous_slots_are_bounded``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchestrator.slots.anonymous import AnonymousSlots, is_anonymous
from orchestrator.slots.model import Slot
from orchestrator.tenants.principal import DEFAULT_TENANT
from tests.orchestrator.fake_world import World, request


def anonymous_ids(w: World) -> set[str]:
    return {s.id for s in w.registry.slots.values() if is_anonymous(s.id)}


async def test_room_is_made_from_the_least_recently_used_slot_even_while_a_park_holds_it(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=4)
    room = AnonymousSlots(w.registry, max_slots=2)
    w.service.anonymous = room
    held, release = asyncio.Event(), asyncio.Event()
    await w.registry.start()
    try:
        first = await w.run(request(None, [11] * 8, 2))
        second = await w.run(request(None, [22] * 8, 2))
        assert anonymous_ids(w) == {first.slot_id, second.slot_id}
        oldest = w.registry.find(first.slot_id)
        assert oldest is not None and not oldest.busy

        async def park() -> None:  # what a park or a background save does: hold the idle slot's lock
            async with oldest.lock:
                held.set()
                await release.wait()

        parking = asyncio.create_task(park())
        await held.wait()
        making = asyncio.create_task(room._make_room(oldest.tenant))
        await asyncio.sleep(0.05)
        assert not making.done(), "the deletion waits for the park"
        assert anonymous_ids(w) == {first.slot_id, second.slot_id}, "nothing deleted while it waits"
        release.set()
        await asyncio.wait_for(making, 10)
        await parking
        assert anonymous_ids(w) == {second.slot_id}, "the least recently used slot went, not the next one"

        third = await w.run(request(None, [33] * 8, 2))
        assert anonymous_ids(w) == {second.slot_id, third.slot_id}
    finally:
        release.set()  # a failed assert must not leave the lock held over the shutdown
        await w.registry.shutdown()


async def test_a_slot_that_cannot_be_deleted_is_passed_over_once(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=4)
    room = AnonymousSlots(w.registry, max_slots=2)
    w.service.anonymous = room
    await w.registry.start()
    try:
        first = await w.run(request(None, [11] * 8, 2))
        second = await w.run(request(None, [22] * 8, 2))
        refused: list[str] = []
        delete = w.registry.delete

        async def refuse_the_oldest(slot: Slot) -> bool:
            if slot.id == first.slot_id:
                refused.append(slot.id)
                return False  # its stored copy out of reach, say
            return await delete(slot)

        w.registry.delete = refuse_the_oldest  # type: ignore[method-assign]
        await asyncio.wait_for(room._make_room(DEFAULT_TENANT), 10)
        assert refused == [first.slot_id], "tried once, not again and again"
        assert anonymous_ids(w) == {first.slot_id}, "the next least recently used one made the room"
        assert second.slot_id not in anonymous_ids(w)
    finally:
        await w.registry.shutdown()
