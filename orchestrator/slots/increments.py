"""Incremental states: what a turn stores of a slot is the KV chunks its new tokens touched.

A stored slot is the metadata naming its first KV cache's chunks in position order
(:attr:`storage.base.SlotMeta.chunks`) plus the rest of the state (a sliding-window model's sliding
cache, bounded by its window) and the chunks themselves, shared by key (:mod:`slotstate.kv_chunks`:
the key covers the model, tenant, cache partition and token prefix).  :meth:`Increments.snapshot`
plans a save: the ranges of the chunks (:func:`slotstate.kv_chunks.plan_ranges`, from the ranges of this
node's last save of the slot and how many of its tokens are unchanged since, cut at the end of the first
chat message so that conversations sharing a system prompt share all of its KV), their keys, and which
of them must be read from the engine (``llama_attn_seq_range_get``: those the store lacks); it reads
those and the rest, and seals the new chunks for the store.  A save in the background asks the store
first, without the slot's lock (:meth:`Increments.known`), so a stalled store never holds the slot.

A model whose state holds a recurrent part (recurrent, hybrid) is stored whole, as a store without
chunks (:attr:`orchestrator.slots.persistence.SlotArchive.keeps_chunks`) stores every state.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import numpy as np

from contract import protocol as proto
from contract.protocol import KVRange
from orchestrator.engine_client.interface import EngineClient
from orchestrator.slots.model import Slot
from orchestrator.slots.persistence import SlotArchive
from slotstate import kv_chunks
from storage.base import ChunkRef, SlotMeta

__all__ = ["READ_GROUP", "ChunkedSnapshot", "Increments"]

READ_GROUP = 2  # KV ranges per read from the engine when a save reads several (two chunks: ~12 MB for a 135M model)


@dataclass
class ChunkedSnapshot:
    """A slot's state as a save stores it incrementally: its ``tokens``, ``chunks`` (in position order),
    the ``new`` chunks the store lacks (key -> sealed record; none when they were written ahead) and the ``rest``
    of the state (the one-stream state's bytes after the first KV cache's record); ``writing``: the writes of the
    chunks written ahead still in flight (the metadata that names them is committed once they are done), None
    when none are."""

    tokens: list[int]
    chunks: list[ChunkRef]
    new: dict[str, bytes] = field(default_factory=dict)
    rest: bytes = b""
    writing: asyncio.Future[list[int]] | None = None

    async def settle(self) -> None:
        """Once the snapshot's save is over (stored, refused, failed or never run): stop the writes of
        :attr:`writing` still in flight (their chunks stay unnamed until swept) and take their outcome."""
        if self.writing is not None:
            self.writing.cancel()
            await asyncio.gather(self.writing, return_exceptions=True)


@dataclass
class _Saved:
    generation: int
    tokens: list[int]
    chunks: list[ChunkRef]


class Increments:
    """Plans and reads incremental saves (module docstring); remembers each slot's last save by this node."""

    def __init__(self, engine: EngineClient, archive: SlotArchive, chunk_tokens: int = kv_chunks.CHUNK_TOKENS) -> None:
        self.engine = engine
        self.archive = archive
        self.chunk_tokens = chunk_tokens
        self.saved: dict[str, _Saved] = {}

    def applies(self) -> bool:
        """Whether states are stored incrementally: the store keeps chunks and the model's state is KV
        caches only (``kv`` or ``iswa``)."""
        info = self.engine.info
        return self.archive.keeps_chunks and info is not None and info.memory.type in ("kv", "iswa")

    def _scope(self, slot: Slot) -> bytes:
        return "\0".join((self.archive.fingerprint(), slot.tenant, slot.partition)).encode()

    async def known(self, slot: Slot) -> dict[str, int]:
        """The stored size (-1: absent) of each chunk of this node's last save or restore of ``slot``, asked from
        the store, which touches them (kept from the sweep until the save commits): called without the slot's
        lock, then given to :meth:`snapshot`.  Empty when this node knows no chunks of it;
        ``STORE_UNAVAILABLE``."""
        last = self.saved.get(slot.key)
        if last is None or not last.chunks:
            return {}
        keys = [c.key for c in last.chunks]
        return dict(zip(keys, await self.archive.has_chunks(keys), strict=True))

    async def snapshot(
        self, slot: Slot, flush: bool = True, known: dict[str, int] | None = None, write_ahead: bool = False
    ) -> ChunkedSnapshot | None:
        """Read what a save of ``slot`` (resident, lock held) must store; None for an empty sequence (stored
        whole: a state of no cells has no chunks).  ``flush`` False: the last generated token's pending write
        (a decode step) is left alone and the snapshot holds the tokens whose KV is in the cache (one fewer: a
        strict turn's commit, whose write-behind save then stores that token).  ``known``: the chunks' sizes
        from :meth:`known` (no store call here: a chunk not in it is read from the engine, and the store keeps
        it once); None: asked from the store now (``STORE_UNAVAILABLE`` when the store cannot say which chunks
        it has), while the chunks this node's last save did not name are read (the new tokens' chunks, which the
        store lacks but where another conversation stored the same tokens): a turn's commit waits for the
        longer of the two round trips, not their sum.  ``write_ahead``: each group of new chunks is written to the
        store as soon as it is sealed, while the next group is read (for a caller that holds the slot's lock until
        its write: a failed or stalled store fails or holds the save, as it would the write); the writes still in
        flight are the snapshot's :attr:`ChunkedSnapshot.writing`, which the metadata's commit waits for while the
        store prepares it.  Either way a failure here stops every write this started."""
        seq = slot.seq
        assert seq is not None
        info = self.engine.info
        assert info is not None
        tokens = await self.engine.tokens(seq) if flush else (await self.engine.read_kv(seq, [])).tokens
        if not tokens:
            return None
        last = self.saved.get(slot.key)
        if last is not None and (slot.synced is None or slot.synced[0] != last.generation):
            last = None  # the store holds another version than this node's last save
        stored = [(c.p0, c.p1) for c in last.chunks] if last else []
        same = _common_prefix(last.tokens, tokens) if last else 0
        ids = np.asarray(tokens, dtype="<i4")  # one conversion for the cut and the keys
        cut = _first_message_end(ids, info.eog_token_ids)
        ranges = kv_chunks.plan_ranges(len(tokens), stored, same, self.chunk_tokens, cut)
        keys = kv_chunks.chunk_keys(self._scope(slot), ids, ranges)
        rest_want = [KVRange(c, 0, len(tokens)) for c in range(1, info.memory.kv_caches)]
        puts: list[asyncio.Future[int]] | None = [] if write_ahead else None
        try:
            records, read, sizes = await self._read_absent(seq, tokens, ranges, keys, rest_want, last, known, puts)
        except BaseException:
            for put in puts or ():  # chunks a write in flight still stores stay unnamed until swept
                put.cancel()
            await asyncio.gather(*(puts or ()), return_exceptions=True)
            raise
        rest = b"".join(b"\1\0\0\0" + bytes(r) for r in records[len(read) :])  # u32 n_stream 1 | record
        for j, i in enumerate(read):
            sizes[i] = len(records[j])
        chunks = [ChunkRef(p0, p1, k, size) for (p0, p1), k, size in zip(ranges, keys, sizes, strict=True)]
        new = {} if write_ahead else {keys[i]: records[j] for j, i in enumerate(read)}  # (written ahead: in puts)
        return ChunkedSnapshot(tokens, chunks, new, rest, asyncio.gather(*puts) if puts else None)

    async def _read_absent(
        self,
        seq: int,
        tokens: list[int],
        ranges: list[tuple[int, int]],
        keys: list[str],
        rest_want: list[KVRange],
        last: _Saved | None,
        known: dict[str, int] | None,
        puts: list[asyncio.Future[int]] | None,
    ) -> tuple[list[bytes], list[int], list[int]]:
        """:meth:`snapshot`'s reads: the records of the chunks (``ranges`` of the first KV cache, under ``keys``)
        the store lacks then of ``rest_want`` (:meth:`_read`, writing ahead into ``puts`` unless None), which
        chunks they are (indices into ``keys``, in the records' order) and every chunk's stored size (-1: absent)."""

        def wanted(indices: list[int]) -> list[KVRange]:
            return [KVRange(0, *ranges[i]) for i in indices]

        # every key is asked (and so touched: kept from the sweep until this commit), those of the last
        # save too: a chunk lost from the store since is read again rather than named missing
        if known is not None or last is None or not keys:
            if known is not None:
                sizes = [known.get(k, -1) for k in keys]
            else:
                sizes = await self.archive.has_chunks(keys) if keys else []
            read = [i for i, size in enumerate(sizes) if size < 0]
            return await self._read(seq, tokens, wanted(read) + rest_want, [keys[i] for i in read], puts), read, sizes
        # a turn after this node's last save: the chunks the last save did not name (those the new tokens
        # touched: their keys cover the new tokens) are read while the store is asked, so the store's
        # round trip overlaps the engine's; one the store had anyway (another conversation's same tokens)
        # is only touched by the write
        named = {c.key for c in last.chunks}
        read = [i for i, k in enumerate(keys) if k not in named]
        reading = asyncio.ensure_future(
            self._read(seq, tokens, wanted(read) + rest_want, [keys[i] for i in read], puts)
        )
        try:
            sizes = await self.archive.has_chunks(keys)
        except BaseException:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            raise
        records = await reading
        lost = [i for i, size in enumerate(sizes) if size < 0 and keys[i] in named]
        if lost:  # chunks of the last save the store lost since: read again
            more = await self._read(seq, tokens, wanted(lost), [keys[i] for i in lost], puts)
            records = records[: len(read)] + more + records[len(read) :]
            read += lost
        return records, read, sizes

    async def _read(
        self,
        seq: int,
        tokens: list[int],
        want: list[KVRange],
        keys: list[str],
        puts: list[asyncio.Future[int]] | None = None,
    ) -> list[bytes]:
        """The records of ``want`` read from the engine, the first ``len(keys)`` sealed under ``keys``
        (:func:`slotstate.kv_chunks.seal`), the rest as read.  Read :data:`READ_GROUP` ranges at a time with the
        next group's read in flight while a thread seals the last (the worker reads and sends one group while
        this process receives and seals another), so a long state is not read, then sealed, one after the other;
        and another sequence's decode waits for one group's read at most, not the whole state's.  Sealing copies
        each record: their receive buffers go back to the engine client (they serve the next reads).  With
        ``puts`` each group's sealed chunks go to the store at once (:meth:`SlotArchive.put_chunks`), so the
        writes overlap the next reads: the writes in flight are appended to ``puts`` (the caller awaits them, or
        cancels them when it fails).

        Raises RuntimeError when the sequence changed meanwhile (the slot's lock forbids it), and what
        ``read_kv`` raises."""
        groups = [want[g : g + READ_GROUP] for g in range(0, len(want), READ_GROUP)]

        async def fetch(group: list[KVRange]) -> list[proto.Buffer]:
            got = await self.engine.read_kv(seq, group)
            if got.tokens[: len(tokens)] != tokens:
                for r in got.records:
                    self.engine.release_state(r)
                raise RuntimeError("the sequence changed while its state was read")
            # (another sequence's decode step may have written the pending token meanwhile: the ranges, all
            # before it, read the same cells)
            return got.records

        def seal(records: list[proto.Buffer], first: int) -> list[bytes]:
            try:
                return [
                    kv_chunks.seal(r, keys[first + j]) if first + j < len(keys) else bytes(r)
                    for j, r in enumerate(records)
                ]
            finally:
                for r in records:
                    self.engine.release_state(r)

        out: list[bytes] = []
        ahead = asyncio.ensure_future(fetch(groups[0])) if groups else None
        current: asyncio.Future[list[proto.Buffer]] | None = None
        try:
            for g in range(len(groups)):
                assert ahead is not None
                current, ahead = ahead, None
                records = await current
                current = None
                ahead = asyncio.ensure_future(fetch(groups[g + 1])) if g + 1 < len(groups) else None
                first = len(out)
                # shielded: a cancel must not drop the seal before its thread starts (the seal hands the records back)
                out += await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(seal, records, g * READ_GROUP)))
                if puts is not None and first < len(keys):
                    sealed = {keys[i]: out[i] for i in range(first, min(len(out), len(keys)))}
                    puts.append(asyncio.ensure_future(self.archive.put_chunks(sealed)))
        finally:
            # an error or a cancel stopped the loop: the reads in flight, or one done but not yet taken (a cancel
            # that came as it ended), give their buffers back too
            for pending in (current, ahead):
                if pending is not None:
                    pending.cancel()
                    with contextlib.suppress(BaseException):
                        for r in await pending:
                            self.engine.release_state(r)
        return out

    def stored(self, slot: Slot, snap: ChunkedSnapshot, meta: SlotMeta) -> None:
        """Remember that ``snap`` of ``slot`` was stored as ``meta`` (the next save starts from it)."""
        self.saved[slot.key] = _Saved(meta.generation, snap.tokens, snap.chunks)

    def restored(self, slot: Slot, meta: SlotMeta) -> None:
        """Remember that ``slot`` was restored from the store's ``meta`` (its next save starts from its chunks)."""
        if meta.chunks:
            self.saved[slot.key] = _Saved(meta.generation, list(meta.tokens), list(meta.chunks))

    def forget(self, key: str) -> None:
        """Drop what is remembered of slot ``key`` (deleted)."""
        self.saved.pop(key, None)


def _first_message_end(ids: np.ndarray, eog_token_ids: list[int]) -> int:
    """The position after the first end-of-generation token of ``ids`` (a sequence's tokens, ``int32[n]``: the
    end of the first chat message, commonly the system prompt every conversation of a deployment starts with);
    0 without one."""
    if not eog_token_ids:
        return 0
    hits = np.flatnonzero(np.isin(ids, eog_token_ids))
    return int(hits[0]) + 1 if len(hits) else 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens ``a`` and ``b`` share (a list comparison first: a turn's tokens extend the last)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0])
