"""Operations on a slot's KV cells and state I/O: tokens, lending the state, restore, fork,
context shift, erase, slot files.

:class:`SequenceOps` is the member of :class:`orchestrator.slots.registry.SlotRegistry` that
calls the engine's KV operations for a slot whose lock the caller holds; a parked slot is
restored first (:class:`orchestrator.slots.residency.Residency`) or, for reads, served from the
store.  A state read from the engine arrives in a buffer of the engine client's receive pool:
:meth:`SequenceOps.lend_state` lends it inside ``async with`` (:mod:`orchestrator.slots.loan`), so
no caller can forget to hand it back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from contract import protocol as proto
from contract.errors import ErrorCode
from orchestrator.engine_client.interface import EngineClient
from orchestrator.service_error import ServiceError
from orchestrator.slots.durability import Durability
from orchestrator.slots.loan import StateLoan, lent
from orchestrator.slots.model import Slot
from orchestrator.slots.ownership import Ownership
from orchestrator.slots.persistence import OwnershipLost, SlotArchive
from orchestrator.slots.residency import Residency
from slotstate.ses1 import pack_ses1, unpack_ses1


class SequenceOps:
    """KV operations on slots (see module docstring).  ``durability`` None: nothing is stored;
    ``forget(slot)``: the registry drops a slot it made for a request that failed."""

    def __init__(
        self,
        engine: EngineClient,
        residency: Residency,
        ownership: Ownership,
        durability: Durability | None,
        forget: Callable[[Slot], Awaitable[None]],
    ) -> None:
        self.engine = engine
        self.residency = residency
        self.ownership = ownership
        self.durability = durability
        self.archive: SlotArchive | None = durability.archive if durability is not None else None
        self.forget = forget

    def changed(self, slot: Slot) -> None:
        """Mark ``slot`` changed and queue a save (coalesced) when a store is configured."""
        slot.dirty = True
        if self.durability is not None:
            self.durability.schedule(slot)

    async def tokens(self, slot: Slot) -> list[int]:
        """The slot's tokens: from the engine if resident (refreshing ``n_tokens``), else from the store."""
        if self.residency.is_resident(slot):
            tokens = await self.engine.tokens(slot.seq)  # type: ignore[arg-type]
            slot.n_tokens = len(tokens)
            return tokens
        if slot.stored and self.archive is not None:
            meta = await self.archive.lookup(slot.key)
            return list(meta.tokens) if meta is not None else []
        return []

    async def peek_tokens(self, slot: Slot) -> list[int] | None:
        """A resident slot's tokens read from the engine without its lock (a snapshot, for choosing
        a slot: :mod:`orchestrator.slots.anonymous`); None when it is not resident."""
        if not self.residency.is_resident(slot):
            return None
        return await self.engine.tokens(slot.seq)  # type: ignore[arg-type]

    def lend_state(self, slot: Slot) -> AbstractAsyncContextManager[StateLoan | None]:
        """``async with`` the slot's tokens and llama.cpp sequence state (``llama_state_seq_get_data``'s
        format) as a :class:`StateLoan`: read from the engine if resident (its receive buffer, given
        back when the block ends), else a view into the SES1 blob decompressed from the store; None
        when it holds no state.  ``STORE_UNAVAILABLE``, ``BAD_STATE`` (a damaged stored copy)."""
        return lent(self._state(slot))

    async def _state(self, slot: Slot) -> StateLoan | None:
        t0 = time.perf_counter()
        if self.residency.is_resident(slot):
            saved = await self.engine.save_state(slot.seq)  # type: ignore[arg-type]
            ms = (time.perf_counter() - t0) * 1000
            return StateLoan(saved.tokens, saved.state, ms, self.engine.release_state)
        if slot.stored and self.archive is not None:
            got = await self.archive.load(slot.key)
            if got is not None:
                ses1 = unpack_ses1(got[1])
                return StateLoan(list(ses1.tokens), ses1.state, (time.perf_counter() - t0) * 1000)
        return None

    async def restore(self, slot: Slot, tokens: list[int], state: proto.Buffer, created: bool) -> None:
        """Replace the slot's KV state with ``tokens`` and their llama.cpp sequence ``state``.

        On any failure (the engine refuses the state: ``BAD_STATE``; no sequence:
        ``RATE_LIMITED``) the slot is as it was: dropped again if ``created`` (it did not
        exist before the request), back to parked (or empty) if it was not resident.
        """

        async def put(seq: int) -> int:
            await self.engine.restore_state(seq, tokens, state)
            return len(tokens)

        await self._replace(slot, created, put)

    async def restore_file(self, slot: Slot, path: Path, created: bool) -> proto.StateRestored:
        """Replace the slot with the slot file ``path``, read by the worker itself (it shares this
        file system: ``proto.LoadFile``); failures leave the slot as :meth:`restore` does."""
        done: list[proto.StateRestored] = []

        async def put(seq: int) -> int:
            done.append(await self.engine.load_file(seq, str(path)))
            return done[0].n_tokens

        await self._replace(slot, created, put)
        return done[0]

    async def _replace(self, slot: Slot, created: bool, put: Callable[[int], Awaitable[int]]) -> None:
        """Give the slot a sequence (not loading its stored state) and let ``put(seq)`` replace its
        cells (returning its new token count); the slot is as it was when anything fails (see
        :meth:`restore`)."""
        was_resident = self.residency.is_resident(slot)
        try:
            seq = await self.residency.ensure_resident(slot, load=False)
            n = await put(seq)
        except BaseException:
            if created:
                await self.forget(slot)
            elif not was_resident:
                self.residency.unload(slot)
            raise
        slot.n_tokens = n
        slot.n_prompt_tokens_processed = 0
        self.changed(slot)

    async def save_file(self, slot: Slot, path: Path) -> proto.FileSaved | None:
        """Write the resident slot to the slot file ``path`` from the worker (``proto.SaveFile``);
        ``None`` when the slot is not resident (its state is then in the store)."""
        if not self.residency.is_resident(slot):
            return None
        return await self.engine.save_file(slot.seq, str(path))  # type: ignore[arg-type]

    async def context_shift(self, slot: Slot, n_keep: int, n_discard: int) -> int:
        """llama-server's context shift on the slot (restored first if parked); the new token count."""
        seq = await self.residency.ensure_resident(slot)
        slot.n_tokens = len(await self.engine.context_shift(seq, n_keep, n_discard))
        self.changed(slot)
        return slot.n_tokens

    async def erase(self, slot: Slot) -> None:
        """Drop the slot's cells and its stored state; it stays known, empty."""
        if self.residency.is_resident(slot):
            await self.engine.erase(slot.seq)  # type: ignore[arg-type]
        if slot.stored and self.archive is not None:
            try:
                await self.archive.delete(slot.key, await self.ownership.fence(slot))
            except OwnershipLost:
                self.ownership.disown(slot)
                await self.ownership.drop_copy(slot)
                raise
        if self.durability is not None:
            self.durability.pending.discard(slot.key)
        slot.stored, slot.dirty, slot.n_tokens = False, False, 0
        if self.archive is not None:
            slot.synced = (0, "")

    async def fork(self, src: Slot, dst: Slot) -> int:
        """Make ``dst`` a copy-on-write copy of ``src`` (shared cells); returns its token count.

        When no engine sequence is free for ``dst`` (every other slot busy), the copy is
        made in the store instead: ``dst`` starts parked with ``src``'s state.
        """
        try:
            # Holding two slots, a fork never queues for a sequence: the one it would wait for may
            # be the other slot's.  dst never evicts src: src's lock is held.
            src_seq = await self.residency.ensure_resident(src, queue=False)
            dst_seq = await self.residency.ensure_resident(dst, load=False, queue=False)
        except ServiceError as exc:
            if exc.code != ErrorCode.RATE_LIMITED or self.durability is None or self.residency.is_resident(dst):
                raise
            async with self.lend_state(src) as got:
                if got is None:
                    raise ServiceError(ErrorCode.NO_CACHED_CONTEXT, f"slot {src.id!r} holds no state") from exc
                self.durability.archive.check_up()
                ses1 = await asyncio.to_thread(pack_ses1, got.tokens, got.state)
            await self.durability.save_copy(dst, got.tokens, ses1)
            return dst.n_tokens
        dst.n_tokens = len(await self.engine.fork(src_seq, dst_seq))
        self.changed(dst)
        return dst.n_tokens
