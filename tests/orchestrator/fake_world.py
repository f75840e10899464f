"""A slotserve node in-process for tests: the fake engine, a directory store, the registry.

:class:`World` wires a :class:`tests.orchestrator.fake_engine.FakeEngine`, a
:class:`storage.directory.DirectoryStore` (counting its writes, and able to fail on demand),
the archive, a lease keeper, the registry and the generation service as ``orchestrator/app.py``
wires them.
"""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from orchestrator.generation.events import DoneOut
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.service import GenerationService, RunControl
from orchestrator.slots.admission import AdmissionQueue
from orchestrator.slots.leases import LeaseKeeper
from orchestrator.slots.persistence import SlotArchive
from orchestrator.slots.registry import SlotRegistry
from storage.base import SlotMeta
from storage.directory import DirectoryStore
from storage.errors import StoreUnavailableError
from tests.orchestrator.fake_engine import FakeEngine, next_token
from tests.waiting import DEADLINE_S, async_wait_until

PROMPT = [5, 17, 42, 8]


class CountingStore(DirectoryStore):
    """A directory store that counts ``put`` calls per slot id."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.puts: dict[str, int] = {}

    async def put(
        self,
        meta: SlotMeta,
        blob: bytes | memoryview,
        *,
        lease: str | None = None,
        ready: Awaitable[object] | None = None,
    ) -> SlotMeta:
        self.puts[meta.slot_id] = self.puts.get(meta.slot_id, 0) + 1
        return await super().put(meta, blob, lease=lease, ready=ready)


class FlakyStore(CountingStore):
    """A counting directory store that fails every call while :attr:`down` is set."""

    down = False

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name in ("put", "get", "get_meta", "list_meta", "delete", "acquire_lease", "ping") and self.down:

            async def fail(*_: object, **__: object) -> None:
                raise StoreUnavailableError("the test took the store down")

            return fail
        return attr


class World:
    """One node: fake engine, store, archive, leases, registry, generation service."""

    def __init__(
        self,
        root: Path,
        n_seqs: int = 2,
        *,
        node: str = "node-a",
        store: CountingStore | None = None,
        write_delay_s: float = 0.05,
        step_s: float = 0.001,
        queue_size: int = 8,
        park_idle_s: float | None = None,
        strict: bool = False,
        lease_ms: int = 3000,
    ) -> None:
        self.engine = FakeEngine(n_seqs, step_s)
        self.store = store or CountingStore(root)
        engine = self.engine
        self.archive = SlotArchive(
            self.store,
            lambda: engine.info.fingerprint,  # type: ignore[union-attr]
            codec="auto",
            level=3,
            store_timeout_s=3.0,
        )
        self.leases = LeaseKeeper(self.archive, node, lease_ms=lease_ms)
        self.registry = SlotRegistry(
            engine,  # type: ignore[arg-type]
            n_seqs,
            self.archive,
            self.leases,
            AdmissionQueue(queue_size, 5.0),
            write_delay_s=write_delay_s,
            park_idle_s=park_idle_s,
            upkeep_s=0.05,
            strict=strict,
        )
        self.registry.wait_s = 5.0
        self.service = GenerationService(engine, self.registry)  # type: ignore[arg-type]

    async def gen(
        self, slot: str, ids: list[int], n: int = 4, *, wait: bool = False, control: RunControl | None = None
    ) -> DoneOut:
        """Run one generation to its end; its :class:`DoneOut`."""
        return await self.run(request(slot, ids, n, wait), control)

    async def run(self, req: CanonicalRequest, control: RunControl | None = None) -> DoneOut:
        """Run ``req`` on the generation service to its end; its :class:`DoneOut`."""
        done = None
        async for ev in self.service.run(req, control):
            if isinstance(ev, DoneOut):
                done = ev
        assert done is not None
        return done

    def seq_tokens(self, slot_id: str) -> list[int]:
        """The engine's tokens of a resident slot."""
        slot = self.registry.slots[slot_id]
        assert self.registry.is_resident(slot) and slot.seq is not None
        return self.engine.seqs[slot.seq]


def request(slot: str | None, ids: list[int], n: int, wait: bool = False) -> CanonicalRequest:
    """A greedy generation request of ``n`` tokens."""
    return CanonicalRequest(
        request_id=None,
        input_ids=list(ids),
        prompt=None,
        max_new_tokens=n,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repeat_penalty=1.0,
        repeat_last_n=64,
        seed=1,
        stop_tokens=[],
        banned_tokens=[],
        stop_strings=[],
        ignore_eos=True,
        attention=False,
        attention_format="per_layer",
        attention_dtype="float32",
        attention_layers=None,
        hidden_state=False,
        n_probs=0,
        slot=slot,
        wait=wait,
    )


def greedy(ids: list[int], n: int) -> list[int]:
    """What the fake model generates after ``ids`` (``n`` tokens)."""
    out = list(ids)
    for _ in range(n):
        out.append(next_token(out))
    return out[len(ids) :]


async def wait_for(cond: Any, timeout: float = DEADLINE_S) -> None:
    """Poll ``cond()`` until true (fails as hung after ``timeout`` seconds)."""
    await async_wait_until(cond, "condition", timeout)


async def saved(w: World, slot_id: str) -> None:
    """Wait until the write-behind has stored the slot's current state (its write ended)."""
    await wait_for(lambda: not w.registry.slots[slot_id].dirty)
    await w.archive.settled(slot_id)  # the state was read: its write holds the write lock now
