"""The slot registry's members, each alone (:mod:`orchestrator.slots.loan`,
:mod:`orchestrator.slots.sequences`), and the anonymous slot of a conversation whose park is under
way when its next turn arrives; in-process (:mod:`tests.orchestrator.fake_world`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.generation.events import DoneOut
from orchestrator.generation.request import CanonicalRequest
from orchestrator.slots.loan import StateLoan, lent
from tests.orchestrator.fake_world import PROMPT, World, greedy, request


class Returns:
    """A ``release_state`` that records what it was handed back."""

    def __init__(self) -> None:
        self.given: list[bytes] = []

    def __call__(self, state: object) -> None:
        self.given.append(bytes(state))  # type: ignore[call-overload]


async def loan_of(returns: Returns) -> StateLoan:
    return StateLoan([1, 2, 3], b"state", 1.5, returns)


async def test_a_loan_goes_back_when_its_block_ends_whatever_happens() -> None:
    returns = Returns()
    async with lent(loan_of(returns)) as loan:
        assert loan is not None and loan.n_tokens == 3 and loan.ses1_size == 8 + 12 + 5
    assert returns.given == [b"state"]
    with pytest.raises(RuntimeError):
        async with lent(loan_of(returns)):
            raise RuntimeError("the borrower failed")
    assert len(returns.given) == 2, "given back on an error too"
    async with lent(loan_of(returns)) as loan:
        assert loan is not None
        done = loan.hand_off()  # an answer sent after the block
    assert len(returns.given) == 2, "handed off: not given back at the block's end"
    assert loan.ses1_size == 25 and loan.n_tokens == 3, "its sizes stay readable"
    done()
    done()
    assert len(returns.given) == 3, "given back once, by the new owner"
    async with lent(asyncio.sleep(0, None)) as nothing:
        assert nothing is None


async def test_the_registry_lends_a_resident_state_and_takes_it_back(tmp_path: Path) -> None:
    w = World(tmp_path)
    returns = Returns()
    w.engine.release_state = returns  # type: ignore[method-assign]
    await w.gen("s", PROMPT, 2)
    async with w.registry.use("s", resident=False) as slot, w.registry.kv.lend_state(slot) as loan:
        assert loan is not None and loan.tokens == [*PROMPT, *greedy(PROMPT, 2)]
        assert returns.given == []
    assert len(returns.given) == 1
    await w.registry.shutdown()


def turn(ids: list[int], n: int) -> CanonicalRequest:
    return request(None, ids, n)


async def test_a_turn_arriving_while_its_slot_is_parked_continues_on_it(tmp_path: Path) -> None:
    """One engine sequence.  Conversation A's anonymous slot is being parked for B (its cells erased,
    its sequence not yet free) when A's next turn arrives: the turn waits for the park and continues
    A's slot from the store; before, it found the slot empty and got a new, empty anonymous slot."""
    w = World(tmp_path, n_seqs=1)
    await w.registry.start()
    gate = asyncio.Event()
    erase = w.engine.erase

    async def slow_erase(seq: int) -> None:  # the window between erasing the cells and freeing the sequence
        await erase(seq)
        if not gate.is_set():
            await gate.wait()

    try:
        ids = PROMPT * 10
        done_a = await w.run(turn(ids, 3))
        w.engine.erase = slow_erase  # type: ignore[method-assign]
        b = asyncio.create_task(w.run(turn([77] * 12, 2)))  # parks A's slot for its sequence
        await asyncio.sleep(0.05)
        slot_a = w.registry.find(done_a.slot_id)
        assert slot_a is not None and slot_a.lock.locked(), "A's slot is being parked"
        nxt = [*ids, *greedy(ids, 3), 5]
        a = asyncio.create_task(w.run(turn(nxt, 2)))
        await asyncio.sleep(0.05)
        gate.set()
        await b
        again = await a
        assert again.slot_id == done_a.slot_id, "A's turn continued its own slot"
        assert again.n_cached == len(ids) + 3
        anon = [s for s in w.registry.slots.values() if s.id.startswith("anon-")]
        assert len(anon) == 2, "no empty slot left behind"
    finally:
        gate.set()
        await w.registry.shutdown()


async def test_two_users_at_once_keep_their_own_slots(tmp_path: Path) -> None:
    """Two users continue their own conversations at once, three turns, no slot id (strict
    durability, as the server's default): each keeps one slot and finds its whole previous turn."""
    w = World(tmp_path, n_seqs=2, strict=True)
    await w.registry.start()
    try:
        ids = {"A": PROMPT * 8, "B": [40, 41, 42] * 10}
        seen: dict[str, list[DoneOut]] = {"A": [], "B": []}
        for _ in range(3):
            got = await asyncio.wait_for(asyncio.gather(*(w.run(turn(ids[u], 3)) for u in "AB")), 30)
            for u, done in zip("AB", got, strict=True):
                if seen[u]:
                    assert done.n_cached == len(ids[u]) - 1, "the whole previous turn is cached"
                seen[u].append(done)
                ids[u] = [*ids[u], *greedy(ids[u], 3), 6]
        assert {d.slot_id for d in seen["A"]} & {d.slot_id for d in seen["B"]} == set()
        assert all(len({d.slot_id for d in seen[u]}) == 1 for u in "AB")
    finally:
        await w.registry.shutdown()
