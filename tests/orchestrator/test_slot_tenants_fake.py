"""Every slot has an owner tenant, and no cache crosses a tenant or a ``cache_salt`` (docs/operations.md,
"Tenants"): the registry, the anonymous pick, conversation keys and the stored Responses conversations,
on the in-process node of :mod:`tests.orchestrator.fake_world` (fake engine, real directory store).

The same over HTTP, with the real engine and Redis, is ``tests/orchestrator/test_tenants_api.py``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from contract.errors import ErrorCode
from orchestrator.generation.request import CanonicalRequest
from orchestrator.service_error import ServiceError
from orchestrator.slots.anonymous import AnonymousSlots, is_anonymous
from orchestrator.slots.conversations import Kept, StoredConversations
from orchestrator.slots.model import partition_of, slot_key, split_key
from orchestrator.tenants.principal import DEFAULT_TENANT, Principal
from tests.orchestrator.fake_world import PROMPT, World, greedy, request, saved

A, B = Principal("alice"), Principal("bob")


def as_(who: Principal, req: CanonicalRequest, salt: str | None = None, key: str | None = None) -> CanonicalRequest:
    """``req`` sent by ``who`` with a ``cache_salt`` and a conversation key."""
    return msgspec.structs.replace(req, principal=who, cache_salt=salt, conversation_key=key)


def test_keys_never_meet() -> None:
    assert slot_key(DEFAULT_TENANT, "chat1") == "chat1", "a server without keys keeps its store keys"
    keys = {slot_key(t, i) for t in (DEFAULT_TENANT, "alice", "bob") for i in ("chat1", "alice/chat1", "x/y", "0")}
    assert len(keys) == 12, "no two (tenant, id) pairs share a key"
    for t in (DEFAULT_TENANT, "alice"):
        for i in ("chat1", "alice/chat1", "x/y"):
            assert split_key(slot_key(t, i)) == (t, i)
    assert partition_of(None) == partition_of("") == "" and partition_of("s1") != partition_of("s2")
    assert "s1" not in partition_of("s1")


async def test_two_tenants_name_the_same_slot(tmp_path: Path) -> None:
    w = World(tmp_path)
    await w.registry.start()
    try:
        a = await w.run(as_(A, request("chat1", PROMPT, 4)))
        other = [9, 9, 9, 9, 9]
        b = await w.run(as_(B, request("chat1", other, 4)))
        assert b.n_cached == 0, "bob's chat1 is not alice's"
        sa, sb = w.registry.find("chat1", "alice"), w.registry.find("chat1", "bob")
        assert sa is not None and sb is not None and sa is not sb
        assert w.registry.find("chat1") is None, "the default tenant has no chat1"
        await saved(w, sa.key)
        await saved(w, sb.key)
        ma, mb = await w.archive.lookup("alice/chat1"), await w.archive.lookup("bob/chat1")
        assert ma is not None and mb is not None and (ma.tenant, mb.tenant) == ("alice", "bob")
        assert ma.tokens == [*PROMPT, *greedy(PROMPT, 4)] and mb.tokens[:5] == other
        again = await w.run(as_(A, request("chat1", [*ma.tokens, 3], 2)))
        assert again.n_cached == len(ma.tokens) and a.seq_tokens == len(ma.tokens)
    finally:
        await w.registry.shutdown()


async def test_another_tenants_slot_is_missing_exactly_as_a_missing_one(tmp_path: Path) -> None:
    w = World(tmp_path)
    await w.registry.start()
    try:
        await w.run(as_(A, request("secret", PROMPT, 2)))
        errors = []
        for slot_id in ("secret", "never-made"):
            with pytest.raises(ServiceError) as got:
                async with w.registry.use(slot_id, tenant="bob", create=False, resident=False):
                    pass
            errors.append((got.value.code, got.value.message.replace(slot_id, "ID")))
        assert errors[0] == errors[1] == (ErrorCode.SLOT_NOT_FOUND, "slot 'ID' does not exist")
        assert not await w.registry.exists("secret", "bob") and await w.registry.exists("secret", "alice")
        assert [s.id for s in w.registry.of_tenant("bob")] == [], "bob's look-ups made no slot"
        slot = w.registry.find("secret", "alice")
        assert slot is not None and slot.n_tokens == len(PROMPT) + 2, "alice's slot is unchanged"
    finally:
        await w.registry.shutdown()


async def test_the_anonymous_pick_stays_in_the_tenant_and_salt(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=4)
    await w.registry.start()
    try:
        memo = list(range(100, 160))
        first = await w.run(as_(A, request(None, memo, 4), salt="s1"))
        turn = [*memo, *greedy(memo, 4), 7, 8]
        for who, salt in ((B, "s1"), (A, "s2"), (A, None), (B, None)):
            other = await w.run(as_(who, request(None, turn, 2), salt=salt))
            assert other.n_cached == 0, f"{who.tenant} with salt {salt!r} got alice's s1 cache"
            assert other.slot_id != first.slot_id
        same = await w.run(as_(A, request(None, turn, 2), salt="s1"))
        assert same.slot_id == first.slot_id and same.n_cached == len(memo) + 4, "alice's own turn continues"
        owners = {(s.tenant, s.partition) for s in w.registry.slots.values() if is_anonymous(s.id)}
        assert owners == {(t, partition_of(x)) for t, x in (("alice", "s1"), ("bob", "s1"), ("alice", "s2"),
                                                              ("alice", None), ("bob", None))}  # fmt: skip
        stored = await w.service.anonymous.candidates("bob", partition_of("s1"))
        assert all(c.slot_id != first.slot_id for c in stored), "bob's candidates never hold alice's slot"
    finally:
        await w.registry.shutdown()


async def test_another_tenant_never_evicts_an_anonymous_slot(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=2)
    w.service.anonymous = AnonymousSlots(w.registry, max_slots=1)
    await w.registry.start()
    try:
        mine = await w.run(as_(A, request(None, PROMPT, 2)))
        for n in range(3):
            await w.run(as_(B, request(None, [50 + n] * 8, 2)))
        assert w.registry.find(mine.slot_id, "alice") is not None, "bob's new slots did not delete alice's"
        assert len([s for s in w.registry.of_tenant("bob") if is_anonymous(s.id)]) == 1, "bob's own made room"
    finally:
        await w.registry.shutdown()


async def test_a_conversation_key_keeps_one_slot(tmp_path: Path) -> None:
    w = World(tmp_path, n_seqs=2)
    await w.registry.start()
    try:
        ids = PROMPT * 15
        slots, ratios = set(), []
        for turn in range(10):
            done = await w.run(as_(A, request(None, ids, 3), key="session-42"))
            slots.add(done.slot_id)
            if turn:
                ratios.append(done.n_cached / done.n_prompt)
            await w.run(as_(B, request(None, [70 + turn] * 6, 2)))  # another user between
            ids = [*ids, *greedy(ids, 3), 11 + turn]
        assert len(slots) == 1 and "session-42" not in next(iter(slots)), "one slot, its id shows no key"
        print("conversation key: cached/prompt per turn", [round(r, 3) for r in ratios])
        assert min(ratios) >= 0.95, ratios
        b = await w.run(as_(B, request(None, ids, 2), key="session-42"))
        assert b.n_cached == 0 and b.slot_id == next(iter(slots)), "bob's session-42 is bob's own slot"
        assert w.registry.find(b.slot_id, "alice") is not w.registry.find(b.slot_id, "bob")
    finally:
        await w.registry.shutdown()


async def test_a_named_slot_reused_with_another_salt_is_a_miss(tmp_path: Path) -> None:
    w = World(tmp_path)
    await w.registry.start()
    try:
        await w.run(as_(A, request("s", PROMPT, 2), salt="one"))
        again = await w.run(as_(A, request("s", [*PROMPT, 1, 2, 3], 2), salt="two"))
        assert again.n_cached == 0, "a cache of another salt is never reused"
        same = await w.run(as_(A, request("s", [*PROMPT, 1, 2, 3, 4], 2), salt="two"))
        assert same.n_cached > 0
    finally:
        await w.registry.shutdown()


async def test_stored_conversations_cross_nodes_and_stay_in_their_tenant(tmp_path: Path) -> None:
    a, b = World(tmp_path, node="node-a"), World(tmp_path, node="node-b")  # one store directory
    await a.registry.start()
    await b.registry.start()
    try:
        kept = Kept("anon-0123456789abcdef", [{"role": "user", "content": "hi"}])
        await a.registry.conversations.put("alice", "resp_1", kept)
        assert await b.registry.conversations.get("alice", "resp_1") == kept, "another node continues it"
        assert await b.registry.conversations.get("bob", "resp_1") is None, "another tenant's is unknown"
        assert await b.registry.conversations.get("alice", "resp_2") is None
        restarted = StoredConversations(b.archive)  # nothing in memory: from the store
        assert await restarted.get("alice", "resp_1") == kept
        memory_only = StoredConversations(None)
        await memory_only.put("alice", "r", kept)
        assert await memory_only.get("alice", "r") == kept and await memory_only.get("bob", "r") is None
    finally:
        await a.registry.shutdown()
        await b.registry.shutdown()
