"""llama-server's slot actions (docs/api.md, "Slots") on our slots, resident or parked.

Every action holds the slot exclusively (``SLOT_BUSY`` otherwise).  Read-only
actions on a parked slot are served from the store without restoring it; actions
that change the KV cache restore it first.  A rejected request leaves every slot as
it was: SES1 blobs are checked here (magic, lengths, vocabulary) and by the worker
(the llama.cpp state, restored into a scratch sequence first).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from engine import seq_state
from orchestrator.errors import ApiError
from orchestrator.generation import check_tokens
from orchestrator.slots import Slot, SlotRegistry
from storage.errors import BadStateError, FingerprintMismatchError, StoreUnavailableError
from storage.ggsq import pack_seq_file, unpack_seq_file
from storage.ses1 import pack_ses1, unpack_ses1
from storage.slot_codec import load_slot


@dataclass
class SavedState:
    """A slot's SES1 blob and how long it took to produce (ms)."""

    tokens: list[int]
    blob: bytes
    t_ms: float


def message_boundaries(tokens: list[int], eot: int) -> list[dict[str, int]]:
    """Seed 004's ``messages``: each ends at an ``eot`` token (inclusive) or at the last token."""
    out: list[dict[str, int]] = []
    start = 0
    for i, t in enumerate(tokens):
        if t == eot:
            out.append({"index": len(out), "start": start, "end": i})
            start = i + 1
    if start < len(tokens):
        out.append({"index": len(out), "start": start, "end": len(tokens) - 1})
    return out


def confined_path(root: Path | None, filename: str) -> Path:
    """``root/filename`` for llama-server's file actions; refuses any path escape."""
    if root is None:
        raise ApiError("INVALID_REQUEST", "file actions need the server started with --slot-save-path")
    name = Path(filename)
    if (
        not filename
        or name.is_absolute()
        or len(name.parts) != 1
        or filename in (".", "..")
        or "\x00" in filename
        or "\\" in filename
    ):
        raise ApiError("INVALID_REQUEST", f"invalid filename {filename!r}: a plain file name inside --slot-save-path")
    # save writes ".NAME.tmp" first: that name too must fit the file system's limit (NAME_MAX).
    if len(os.fsencode(f".{filename}.tmp")) > os.pathconf(root, "PC_NAME_MAX"):
        raise ApiError("INVALID_REQUEST", f"filename of {len(filename)} characters is too long")
    path = root / name
    if path.is_dir():
        raise ApiError("INVALID_REQUEST", f"invalid filename {filename!r}: it names a directory")
    return path


class SlotOps:
    """The slot actions; HTTP glue is in :mod:`orchestrator.api.slots`."""

    def __init__(self, registry: SlotRegistry, save_path: Path | None) -> None:
        self.registry = registry
        self.engine = registry.engine
        self.save_path = save_path

    def _vocab(self) -> int:
        if self.engine.info is None:
            raise ApiError("NO_MODEL", "No model loaded")
        return self.engine.info.vocab_size

    # ------------------------------------------------------------------ reads

    async def tokens(self, slot: Slot) -> list[int]:
        """The slot's tokens (from the worker if resident, else from the store)."""
        if self.registry.is_resident(slot):
            tokens = await self.engine.tokens(slot.seq)  # type: ignore[arg-type]
            slot.n_tokens = len(tokens)
            return tokens
        if slot.stored and self.registry.persistence is not None:
            meta = await self.registry.persistence.lookup(slot.id)
            return list(meta.tokens) if meta is not None else []
        return []

    async def save_state(self, slot: Slot) -> SavedState:
        """The slot's SES1 blob (from the worker, or decompressed from the store if parked)."""
        t0 = time.perf_counter()
        if self.registry.is_resident(slot):
            state = await self.engine.save_state(slot.seq)  # type: ignore[arg-type]
            blob = pack_ses1(state.tokens, state.state)
            return SavedState(state.tokens, blob, (time.perf_counter() - t0) * 1000)
        pers = self.registry.persistence
        if slot.stored and pers is not None:
            try:
                got = await load_slot(pers.store, slot.id, pers.fingerprint)
            except StoreUnavailableError as exc:
                raise ApiError("STORE_UNAVAILABLE", str(exc)) from exc
            except (FingerprintMismatchError, BadStateError) as exc:
                raise ApiError("BAD_STATE", str(exc)) from exc
            if got is not None:
                meta, raw = got
                return SavedState(list(meta.tokens), raw, (time.perf_counter() - t0) * 1000)
        raise ApiError("NO_CACHED_CONTEXT", f"slot {slot.id!r} holds no state")

    # ------------------------------------------------------------------ writes

    async def restore_state(self, slot: Slot, blob: bytes, created: bool) -> float:
        """Replace the slot with a SES1 blob; on any refusal the slot is as it was.

        ``created`` says the slot did not exist before this request (it is dropped again
        on failure).  Returns the time taken in ms.  Raises ``BAD_STATE`` for a blob
        that is not SES1, has tokens outside the vocabulary, or whose llama.cpp state
        this engine refuses.
        """
        t0 = time.perf_counter()
        was_resident = self.registry.is_resident(slot)
        try:
            try:
                ses1 = unpack_ses1(blob)
            except BadStateError as exc:
                raise ApiError("BAD_STATE", str(exc)) from exc
            try:
                check_tokens(ses1.tokens, self._vocab(), "the state's tokens")
            except ApiError as exc:
                raise ApiError("BAD_STATE", exc.message) from exc
            seq = await self.registry.ensure_resident(slot, load=False)
            await self.engine.restore_state(seq, ses1.tokens, ses1.state)
        except BaseException:
            if created:
                await self.registry.forget(slot)
            elif not was_resident:
                self.registry.unload(slot)  # back to parked (or empty) as before
            raise
        slot.n_tokens = len(ses1.tokens)
        slot.n_prompt_tokens_processed = 0
        self._persist(slot)
        return (time.perf_counter() - t0) * 1000

    async def context_shift(self, slot: Slot, n_keep: int, n_discard: int) -> int:
        """Seed 004's context shift; returns the new token count."""
        n = slot.n_tokens if not self.registry.is_resident(slot) else len(await self.tokens(slot))
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > n:
            raise ApiError(
                "INVALID_REQUEST",
                f"need n_keep >= 0, n_discard > 0 and n_keep + n_discard <= n_tokens ({n})",
                n_tokens=n,
            )
        seq = await self.registry.ensure_resident(slot)
        slot.n_tokens = len(await self.engine.context_shift(seq, n_keep, n_discard))
        self._persist(slot)
        return slot.n_tokens

    async def erase(self, slot: Slot) -> int:
        """Drop the slot's cells and stored state; returns how many tokens it held."""
        n = len(await self.tokens(slot))
        if self.registry.is_resident(slot):
            await self.engine.erase(slot.seq)  # type: ignore[arg-type]
        if slot.stored and self.registry.persistence is not None:
            await self.registry.persistence.delete(slot.id)
        slot.stored, slot.dirty, slot.n_tokens = False, False, 0
        return n

    async def fork(self, src: Slot, dst: Slot) -> int:
        """Make ``dst`` a copy-on-write copy of ``src`` (shared cells); returns its token count.

        When no engine sequence is free for ``dst`` (every other slot busy), the copy is
        made in the store instead: ``dst`` starts parked with ``src``'s state.
        """
        try:
            # Holding two slots, a fork never queues for a sequence: the one it would wait for may
            # be the other slot's.  dst never evicts src: src's lock is held.
            src_seq = await self.registry.ensure_resident(src, queue=False)
            dst_seq = await self.registry.ensure_resident(dst, load=False, queue=False)
        except ApiError as exc:
            pers = self.registry.persistence
            if exc.code != "RATE_LIMITED" or pers is None or self.registry.is_resident(dst):
                raise
            saved = await self.save_state(src)
            await pers.store_blob(dst, saved.tokens, saved.blob)
            return dst.n_tokens
        dst.n_tokens = len(await self.engine.fork(src_seq, dst_seq))
        self._persist(dst)
        return dst.n_tokens

    def _persist(self, slot: Slot) -> None:
        if self.registry.persistence is not None:
            self.registry.persistence.schedule(slot)
        else:
            slot.dirty = True

    # ------------------------------------------------------------------ files (llama-server)

    async def save_file(self, slot: Slot, filename: str) -> tuple[SavedState, int]:
        """Write the slot to ``--slot-save-path/filename`` as llama.cpp's sequence-state file
        (``ggsq``, what llama-server writes: :mod:`storage.ggsq`); returns bytes written."""
        path = confined_path(self.save_path, filename)
        saved = await self.save_state(slot)
        ses1 = unpack_ses1(saved.blob)
        data = pack_seq_file(ses1.tokens, ses1.state)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_bytes(data)
            tmp.replace(path)
        except IsADirectoryError as exc:  # made a directory meanwhile
            raise ApiError("INVALID_REQUEST", f"invalid filename {filename!r}: it names a directory") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return saved, len(data)

    def read_file(self, filename: str) -> tuple[bytes, int]:
        """The ``ggsq`` file ``--slot-save-path/filename`` (llama-server's or ours) as a SES1 blob,
        and the file's size in bytes.

        Read and checked before the restore takes its slot, so a missing file (``INVALID_REQUEST``)
        or one this engine cannot take (``BAD_STATE``) changes nothing.
        """
        path = confined_path(self.save_path, filename)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ApiError("INVALID_REQUEST", f"no saved slot file {filename!r}") from exc
        try:
            parsed = unpack_seq_file(data)
            state = seq_state.single_stream(parsed.state)  # llama-server -np N keeps a KV stream per slot
        except (BadStateError, seq_state.BadStateError) as exc:
            raise ApiError("BAD_STATE", f"Unable to restore slot: {exc}") from exc
        return pack_ses1(parsed.tokens, state), len(data)
