"""Fairness and limits per tenant, and stalled readers, on the fake engine (unit tests).

* the admission queue serves tenants round-robin: a tenant flooding it delays another's request by
  at most one turn per other tenant (a simulated engine with a fake clock);
* ``--tenant-generations``, ``--tenant-resident`` and ``--tenant-stored-bytes`` refuse with
  ``RATE_LIMITED`` and ``retry_after``, changing nothing;
* a generation whose consumer takes nothing for ``--stall-timeout`` is stopped and its slot parked,
  so a waiting request gets the sequence (the real-server version is in test_tenants_server.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from contract.errors import ErrorCode
from orchestrator.generation.events import DoneOut, Started, TokenOut
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import AdmissionQueue, tenant_of
from orchestrator.tenants.limits import TenantLimits
from orchestrator.tenants.principal import DEFAULT_TENANT, Principal
from tests.orchestrator.fake_world import PROMPT, World, request, wait_for


@dataclass(eq=False)
class Waiter:
    """What waits in the queue (a slot stands here: the queue reads only ``tenant``)."""

    tenant: str
    name: str


def jain(xs: list[float]) -> float:
    """Jain's fairness index of the shares ``xs``: 1 when equal, 1/n when one takes all."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


async def test_tenants_take_turns_and_the_position_counts_every_turn_before_it() -> None:
    q: AdmissionQueue[Waiter] = AdmissionQueue(100, 60.0)
    xs = [q.enter(Waiter("x", f"x{i}")) for i in range(5)]
    y = q.enter(Waiter("y", "y0"))
    z = q.enter(Waiter("z", "z0"))
    order = ["x0", "y0", "z0", "x1", "x2", "x3", "x4"]
    assert [t.slot.name for t in q.waiting_tickets] == order
    assert (y.position, z.position, xs[1].position, xs[4].position) == (2, 3, 4, 7)
    q.leave(xs[2])  # a waiter whose client left: the ones behind move up
    assert xs[2].position == 0 and xs[4].position == 6 and len(q) == 6
    served = []
    while (t := q.pop()) is not None:
        served.append(t.slot.name)
    assert served == ["x0", "y0", "z0", "x1", "x3", "x4"]
    assert len(q) == 0 and not q.lanes


async def test_a_tenant_arriving_joins_the_end_of_the_turn_order() -> None:
    q: AdmissionQueue[Waiter] = AdmissionQueue(100, 60.0)
    for i in range(3):
        q.enter(Waiter("x", f"x{i}"))
    q.enter(Waiter("y", "y0"))
    assert q.pop().slot.name == "x0"  # type: ignore[union-attr]
    q.enter(Waiter("z", "z0"))  # x, just served, went to the end of the turn order: z comes after it
    assert [t.slot.name for t in q.waiting_tickets] == ["y0", "x1", "z0", "x2"]


async def test_the_queue_is_bounded_over_all_tenants() -> None:
    q: AdmissionQueue[Waiter] = AdmissionQueue(2, 60.0, retry_after_s=3)
    q.enter(Waiter("x", "x0"))
    q.enter(Waiter("y", "y0"))
    with pytest.raises(ServiceError) as err:
        q.enter(Waiter("z", "z0"))
    assert err.value.code == ErrorCode.RATE_LIMITED and err.value.extra["retry_after"] == 3
    assert len(q) == 2 and q.waiting("z") == 0


def test_a_waiter_without_a_tenant_is_the_default_tenant() -> None:
    assert tenant_of(object()) == DEFAULT_TENANT and tenant_of(Waiter("acme", "a")) == "acme"


async def test_a_flooding_tenant_delays_another_by_one_turn_at_most() -> None:
    """One engine sequence, one turn per generation (fake clock): tenant X keeps 32 requests waiting,
    tenant Y sends one request at a time.  Y waits at most one turn each time (X's); X and Y get
    equal turns while both have work (Jain index 1.0).  A FIFO would make Y wait 32 turns."""
    q: AdmissionQueue[Waiter] = AdmissionQueue(64, 60.0)
    now = 0.0  # the fake clock, in turns
    entered: dict[Waiter, float] = {}

    def enter(w: Waiter) -> None:
        entered[w] = now
        q.enter(w)

    for i in range(32):
        enter(Waiter("x", f"x{i}"))
    enter(Waiter("y", "y0"))
    turns = {"x": 0, "y": 0}
    y_waits: list[float] = []
    for k in range(200):
        ticket = q.pop()
        assert ticket is not None
        w = ticket.slot
        if w.tenant == "y":
            y_waits.append(now - entered[w])
        turns[w.tenant] += 1
        now += 1.0  # the generation runs one turn
        enter(Waiter(w.tenant, f"{w.tenant}{k + 100}"))  # the same client's next request, at once
    assert max(y_waits) <= 1.0, y_waits
    assert len(y_waits) >= 99
    assert jain([float(turns["x"]), float(turns["y"])]) >= 0.99, turns


async def test_three_tenants_wait_at_most_one_turn_per_other_tenant() -> None:
    q: AdmissionQueue[Waiter] = AdmissionQueue(64, 60.0)
    now, entered, waits = 0.0, {}, {"a": [], "b": [], "c": []}  # type: ignore[var-annotated]
    for name, n in (("a", 20), ("b", 1), ("c", 1)):
        for i in range(n):
            w = Waiter(name, f"{name}{i}")
            entered[w] = now
            q.enter(w)
    for k in range(90):
        w = q.pop().slot  # type: ignore[union-attr]
        waits[w.tenant].append(now - entered[w])
        now += 1.0
        nxt = Waiter(w.tenant, f"{w.tenant}-{k}")
        entered[nxt] = now
        q.enter(nxt)
    assert max(waits["b"]) <= 2.0 and max(waits["c"]) <= 2.0, waits


# ----------------------------------------------------------------------------- limits (fake engine)


def req_of(tenant: str, slot: str | None, n: int = 4, wait: bool = True):  # type: ignore[no-untyped-def]
    r = request(slot or "", PROMPT, n, wait)
    r.slot = slot
    r.principal = Principal(tenant)
    return r


async def first_token(gen) -> None:  # type: ignore[no-untyped-def]
    """Advance a run until its first token (the generation then holds its slot and sequence)."""
    async for ev in gen:
        if isinstance(ev, TokenOut):
            return
    raise AssertionError("no token")


async def finish(gen) -> DoneOut:  # type: ignore[no-untyped-def]
    done = None
    async for ev in gen:
        if isinstance(ev, DoneOut):
            done = ev
    assert done is not None
    return done


async def test_generations_per_tenant_are_limited(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=4)
    w.service.limits = TenantLimits(generations=1, retry_after_s=2)
    held = w.service.run(req_of("a", "a1", n=50))
    await first_token(held)
    with pytest.raises(ServiceError) as err:
        await finish(w.service.run(req_of("a", "a2")))
    assert err.value.code == ErrorCode.RATE_LIMITED and err.value.extra["retry_after"] == 2
    assert "a2" not in w.registry.slots  # refused before any slot was made
    assert (await finish(w.service.run(req_of("b", "b1")))).n_generated == 4  # another tenant goes on
    await held.aclose()
    assert (await finish(w.service.run(req_of("a", "a2")))).n_generated == 4  # its place came back


async def test_resident_slots_per_tenant_park_the_tenants_own_idle_slot_first(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=3)
    w.registry.residency.limits = TenantLimits(resident=1)
    await finish(w.service.run(req_of(DEFAULT_TENANT, "s1")))
    assert w.registry.is_resident(w.registry.slots["s1"])
    await finish(w.service.run(req_of(DEFAULT_TENANT, "s2")))  # parks s1 (idle), not a refusal
    assert w.registry.is_resident(w.registry.slots["s2"]) and not w.registry.is_resident(w.registry.slots["s1"])
    held = w.service.run(req_of(DEFAULT_TENANT, "s2", n=50))
    await first_token(held)
    with pytest.raises(ServiceError) as err:  # its one sequence serves a request: nothing to park
        await finish(w.service.run(req_of(DEFAULT_TENANT, "s3")))
    assert err.value.code == ErrorCode.RATE_LIMITED
    assert not w.registry.is_resident(w.registry.slots["s3"])
    await held.aclose()


async def test_stored_bytes_per_tenant_are_limited(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=2, strict=True)
    w.service.limits = TenantLimits(stored_bytes=1)
    await finish(w.service.run(req_of(DEFAULT_TENANT, "s1")))  # stored (strict)
    assert w.registry.slots["s1"].stored_bytes > 0
    with pytest.raises(ServiceError) as err:
        await finish(w.service.run(req_of(DEFAULT_TENANT, "s1")))
    assert err.value.code == ErrorCode.RATE_LIMITED and "erase slots" in err.value.message
    assert (await finish(w.service.run(req_of("other", "o1")))).n_generated == 4


# ------------------------------------------------------------------------------------ stalled readers


async def test_a_stalled_reader_is_parked_and_its_sequence_serves_the_next_request(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=1, queue_size=4)
    w.service.stall_timeout_s = 0.3
    stalled = w.service.run(req_of("a", "reader", n=40))
    got: list[TokenOut] = []
    async for ev in stalled:
        if isinstance(ev, TokenOut):
            got.append(ev)
            break
        assert isinstance(ev, Started)
    # the one sequence is held by a client that reads no more: the next request waits, then gets it
    other = asyncio.ensure_future(finish(w.service.run(req_of("b", "next", n=3))))
    done = await asyncio.wait_for(other, 30)
    assert done.n_generated == 3
    reader = w.registry.find("reader", "a")
    assert reader is not None and not w.registry.is_resident(reader) and reader.stored, (
        "the stalled slot was parked, its state kept"
    )
    # the client reads again: the rest of what was generated, then the end
    rest = [ev async for ev in stalled]
    end = rest[-1]
    assert isinstance(end, DoneOut) and end.finish_reason == "cancelled"
    tokens = [t.token_id for t in got + [e for e in rest if isinstance(e, TokenOut)]]
    assert 1 <= len(tokens) < 40
    # the parked state is the prompt and every token the client got: its next turn continues it
    await wait_for(lambda: not reader.busy)
    assert reader.n_tokens == len(PROMPT) + len(tokens)
    assert await w.registry.kv.tokens(reader) == PROMPT + tokens


async def test_requests_wait_in_their_tenants_lane_through_the_registry(tmp_path: Path) -> None:
    """One engine sequence held by tenant x; x queues three more requests, then y one: y's runs second."""
    w = World(tmp_path, n_seqs=1, queue_size=8)
    held = w.service.run(req_of("x", "x0", n=50))
    await first_token(held)
    order: list[str] = []

    async def one(tenant: str, slot: str) -> None:
        await finish(w.service.run(req_of(tenant, slot, n=2)))
        order.append(slot)

    tasks = []
    for tenant, slot in (("x", "x1"), ("x", "x2"), ("x", "x3"), ("y", "y1")):
        tasks.append(asyncio.ensure_future(one(tenant, slot)))
        await wait_for(lambda n=len(tasks): len(w.registry.queue) == n)
    assert w.registry.queue.waiting("x") == 3 and w.registry.queue.waiting("y") == 1
    await held.aclose()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert order == ["x1", "y1", "x2", "x3"]
