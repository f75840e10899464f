"""A Redis outage longer than the lease (issue: write-behind dropped, strict refused with 409 the
turns a node could keep): the node takes back the leases nobody else took and keeps every turn.

One in-process node (fake engine, :mod:`tests.orchestrator.fake_world`) on a real ``redis-server``
this test starts, stops for longer than the lease and starts again (AOF: the data survives, the
lease keys expire).  The heartbeat is stopped, as in the race where the first write after the
outage comes before the heartbeat has seen the lease lapse.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from storage.redis_store import RedisStore
from tests.orchestrator.fake_world import PROMPT, World, greedy, wait_for
from tests.redis_server import RedisServer

LEASE_MS = 600


@pytest.mark.parametrize("durability", ["write-behind", "strict"])
async def test_turns_across_an_outage_longer_than_the_lease_are_kept(
    own_redis: RedisServer, tmp_path: Path, durability: str
) -> None:
    strict = durability == "strict"
    store = RedisStore.from_url(own_redis.url, prefix=f"outage-{durability}:", socket_timeout=0.5)
    w = World(tmp_path, store=store, lease_ms=LEASE_MS, strict=strict)  # type: ignore[arg-type]
    await w.registry.start()
    assert w.leases._heartbeat is not None
    w.leases._heartbeat.cancel()  # the race: the write comes before the heartbeat notices the lapse
    try:
        await w.gen("s", PROMPT, 2)
        await wait_for(lambda: not w.registry.slots["s"].dirty)
        await w.archive.settled("s")
        ids = [*PROMPT, *greedy(PROMPT, 2), 9]
        own_redis.stop()
        if not strict:
            await w.gen("s", ids, 2)  # answered during the outage; written when the store is back
            ids = [*ids, *greedy(ids, 2), 10]
        await asyncio.sleep(3 * LEASE_MS / 1000)  # longer than the lease: its key expires
        own_redis.start()
        await asyncio.sleep(2.1)  # the archive's breaker (2 s after the last failure) closes
        last = await w.gen("s", ids, 2)  # strict: stored before answered, no 409
        await wait_for(lambda: not w.registry.slots["s"].dirty, timeout=40)
        await w.archive.settled("s")
        meta = await w.archive.lookup("s")
        assert meta is not None and meta.tokens == [*ids, *greedy(ids, 2)], "every answered turn is stored"
        assert last.seq_tokens == len(ids) + 2 and w.leases.holds("s")
    finally:
        await w.registry.shutdown()
