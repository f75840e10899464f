"""llama-server's slot actions (docs/api.md, "Slots") on our slots, resident or parked.

Every action holds the slot exclusively (``SLOT_BUSY`` otherwise).  Read-only
actions on a parked slot are served from the store without restoring it; actions
that change the KV cache restore it first.  A rejected request leaves every slot as
it was: SES1 blobs are checked here (magic, lengths, vocabulary) and by the worker
(the llama.cpp state, restored into a scratch sequence first).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

from contract.buffers import BufferPool
from contract.errors import ErrorCode
from contract.framing import Buffer
from orchestrator.service_error import ServiceError
from orchestrator.slots.registry import Slot, SlotRegistry
from orchestrator.tokens import check_tokens
from slotstate import seq_state
from slotstate.ggsq import SeqFile, read_seq_file, read_seq_head, write_seq_file
from slotstate.ses1 import HEADER_SIZE, ses1_header, unpack_ses1
from storage.errors import BadStateError


@dataclass(frozen=True)
class FileResult:
    """A slot file written or read: the slot's token count, the file's size in bytes, and the ms taken."""

    n_tokens: int
    n_bytes: int
    t_ms: float


@dataclass
class SavedState:
    """A slot's tokens and llama.cpp sequence state (``llama_state_seq_get_data``'s format, in
    the buffer it arrived in), and how long it took to produce (ms)."""

    tokens: list[int]
    state: Buffer
    t_ms: float

    def ses1_chunks(self) -> list[Buffer]:
        """The SES1 blob (:mod:`slotstate.ses1`) as two chunks to send in order (the state not copied)."""
        return [ses1_header(self.tokens), self.state]

    @property
    def ses1_size(self) -> int:
        """Bytes of the SES1 blob."""
        return HEADER_SIZE + 4 * len(self.tokens) + memoryview(self.state).nbytes


def message_boundaries(tokens: list[int], eot: int) -> list[dict[str, int]]:
    """The ``messages`` of ``GET /v1/slots/{id}/info`` (docs/api.md): each ends at an ``eot`` token
    (inclusive) or at the last token."""
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
        raise ServiceError(ErrorCode.INVALID_REQUEST, "file actions need the server started with --slot-save-path")
    name = Path(filename)
    if (
        not filename
        or name.is_absolute()
        or len(name.parts) != 1
        or filename in (".", "..")
        or "\x00" in filename
        or "\\" in filename
    ):
        raise ServiceError(
            ErrorCode.INVALID_REQUEST, f"invalid filename {filename!r}: a plain file name inside --slot-save-path"
        )
    # save writes ".NAME.tmp" first: that name too must fit the file system's limit (NAME_MAX).
    if len(os.fsencode(f".{filename}.tmp")) > os.pathconf(root, "PC_NAME_MAX"):
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"filename of {len(filename)} characters is too long")
    path = root / name
    if path.is_dir():
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"invalid filename {filename!r}: it names a directory")
    return path


class SlotOps:
    """The slot actions: checks, timings and file formats; the registry changes the slots.
    HTTP glue is in :mod:`orchestrator.api.llama_server.slots`.  ``save_path``: ``--slot-save-path``;
    ``worker_files``: the worker shares this file system (spawned here), so it reads and
    writes slot files itself."""

    def __init__(self, registry: SlotRegistry, save_path: Path | None, worker_files: bool = False) -> None:
        self.registry = registry
        self.save_path = save_path
        self.worker_files = worker_files  # the worker shares this file system: it reads and writes slot files

    def _vocab(self) -> int:
        info = self.registry.engine.info
        if info is None:
            raise ServiceError(ErrorCode.NO_MODEL, "No model loaded")
        return info.vocab_size

    def _shape(self) -> seq_state.StateShape:
        """The parts of this model's sequence states (its ``memory``, as the worker reported it)."""
        info = self.registry.engine.info
        if info is None:
            raise ServiceError(ErrorCode.NO_MODEL, "No model loaded")
        return seq_state.StateShape(info.memory.kv_caches, info.memory.type in ("hybrid", "recurrent"))

    # ------------------------------------------------------------------ reads

    async def tokens(self, slot: Slot) -> list[int]:
        """The slot's tokens (from the worker if resident, else from the store)."""
        return await self.registry.tokens(slot)

    async def save_state(self, slot: Slot) -> SavedState:
        """The slot's tokens and state (from the worker, or decompressed from the store if parked)."""
        t0 = time.perf_counter()
        got = await self.registry.state(slot)
        if got is None:
            raise ServiceError(ErrorCode.NO_CACHED_CONTEXT, f"slot {slot.id!r} holds no state")
        return SavedState(got[0], got[1], (time.perf_counter() - t0) * 1000)

    def release(self, saved: SavedState) -> None:
        """``saved``'s state is no longer read: its receive buffer may serve the engine client's next state."""
        self.registry.engine.release_state(saved.state)

    # ------------------------------------------------------------------ writes

    async def restore_state(self, slot: Slot, blob: Buffer, created: bool) -> float:
        """Replace the slot with a SES1 blob (read in place); on any refusal the slot is as it was.

        ``created`` says the slot did not exist before this request (it is dropped again
        on failure).  Returns the time taken in ms.  Raises ``BAD_STATE`` for a blob
        that is not SES1, has tokens outside the vocabulary, or whose llama.cpp state
        this engine refuses.
        """
        t0 = time.perf_counter()
        try:
            ses1 = unpack_ses1(blob)
        except BadStateError as exc:
            if created:
                await self.registry.forget(slot)
            raise ServiceError(ErrorCode.BAD_STATE, str(exc)) from exc
        await self.restore(slot, ses1.tokens, ses1.state, created)
        return (time.perf_counter() - t0) * 1000

    async def restore(self, slot: Slot, tokens: list[int], state: Buffer, created: bool) -> None:
        """Replace the slot with ``tokens`` and their llama.cpp sequence ``state``; on any refusal
        (``BAD_STATE``: tokens outside the vocabulary, a state the engine refuses) the slot is as
        it was, and dropped again when ``created``."""
        try:
            self._check_state_tokens(tokens)
        except BaseException:
            if created:
                await self.registry.forget(slot)
            raise
        await self.registry.restore(slot, tokens, state, created)

    def _check_state_tokens(self, tokens: list[int]) -> None:
        """``BAD_STATE`` unless every token of a state is in the vocabulary."""
        try:
            check_tokens(tokens, self._vocab(), "the state's tokens")
        except ServiceError as exc:
            raise ServiceError(ErrorCode.BAD_STATE, exc.message) from exc

    async def context_shift(self, slot: Slot, n_keep: int, n_discard: int) -> int:
        """The ``context-shift`` slot action (docs/api.md, "Slots"); returns the new token count."""
        n = slot.n_tokens if not self.registry.is_resident(slot) else len(await self.registry.tokens(slot))
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > n:
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                f"need n_keep >= 0, n_discard > 0 and n_keep + n_discard <= n_tokens ({n})",
                n_tokens=n,
            )
        return await self.registry.context_shift(slot, n_keep, n_discard)

    async def erase(self, slot: Slot) -> int:
        """Drop the slot's cells and stored state; returns how many tokens it held."""
        n = len(await self.registry.tokens(slot))
        await self.registry.erase(slot)
        return n

    async def fork(self, src: Slot, dst: Slot) -> int:
        """Make ``dst`` a copy-on-write copy of ``src``; returns its token count (see
        :meth:`orchestrator.slots.registry.SlotRegistry.fork`)."""
        return await self.registry.fork(src, dst)

    # ------------------------------------------------------------------ files (llama-server)

    async def save_file(self, slot: Slot, filename: str) -> FileResult:
        """Write the slot to ``--slot-save-path/filename`` as llama.cpp's sequence-state file
        (``ggsq``, what llama-server writes: :mod:`slotstate.ggsq`), beside the target first and
        renamed over it.  A resident slot is written by the worker when it shares this file
        system (``worker_files``); a parked one (or any, with a standalone worker) from its
        state here, off the event loop.  Raises ``INVALID_REQUEST`` for a bad file name."""
        path = confined_path(self.save_path, filename)
        if self.worker_files:
            done = await self.registry.save_file(slot, path)
            if done is not None:
                return FileResult(done.n_tokens, done.n_bytes, done.t_ms)
        t0 = time.perf_counter()
        saved = await self.save_state(slot)
        try:
            n = await asyncio.to_thread(write_seq_file, path, saved.tokens, saved.state)
        except IsADirectoryError as exc:  # made a directory meanwhile
            raise ServiceError(
                ErrorCode.INVALID_REQUEST, f"invalid filename {filename!r}: it names a directory"
            ) from exc
        finally:
            self.release(saved)  # written (or not)
        return FileResult(len(saved.tokens), n, (time.perf_counter() - t0) * 1000)

    async def saved_file(self, filename: str) -> Path:
        """The slot file ``--slot-save-path/filename`` for the worker to read, checked here first as
        far as this process can (off the event loop, without reading the K/V data): ``ggsq``
        header, token record and vocabulary, the state's structure and length.  So a missing
        (``INVALID_REQUEST``) or damaged file (``BAD_STATE``) is refused before the restore takes
        a slot or a sequence.  Raises ``INVALID_REQUEST`` for a bad file name too."""
        path = confined_path(self.save_path, filename)
        try:
            tokens = await asyncio.to_thread(_check_seq_file, path, self._shape())
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"no saved slot file {filename!r}") from exc
        except seq_state.BadStateError as exc:
            raise ServiceError(ErrorCode.BAD_STATE, f"Unable to restore slot: {exc}") from exc
        self._check_state_tokens(tokens)
        return path

    async def restore_file(self, slot: Slot, path: Path, created: bool) -> FileResult:
        """Replace the slot with the slot file ``path`` (:meth:`saved_file`), read by the worker
        itself (``worker_files`` only); refusals as :meth:`restore`'s (``BAD_STATE`` for a file
        this engine cannot take; the slot as it was, dropped again when ``created``)."""
        t0 = time.perf_counter()
        done = await self.registry.restore_file(slot, path, created)
        return FileResult(done.n_tokens, done.n_bytes, (time.perf_counter() - t0) * 1000)

    async def read_file(self, filename: str, pool: BufferPool) -> tuple[SeqFile, Buffer, int]:
        """The ``ggsq`` file ``--slot-save-path/filename`` (llama-server's or ours) read here, for a
        worker that does not share this file system: its tokens and llama.cpp state, the buffer
        lent by ``pool`` it was read into (once, off the event loop; give it back after the
        restore), and the file's size in bytes.

        Read and checked before the restore takes its slot, so a missing file (``INVALID_REQUEST``)
        or one this engine cannot take (``BAD_STATE``) changes nothing.
        """
        path = confined_path(self.save_path, filename)
        shape = self._shape()
        try:
            parsed, size = await asyncio.to_thread(_read_seq_file, path, pool)
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"no saved slot file {filename!r}") from exc
        except seq_state.BadStateError as exc:
            raise ServiceError(ErrorCode.BAD_STATE, f"Unable to restore slot: {exc}") from exc
        try:
            state = seq_state.single_stream(parsed.state, shape)  # llama-server -np N keeps a KV stream per slot
            seq_state.parse(state, shape=shape)  # its structure and length (header fields only), before a slot is taken
        except seq_state.BadStateError as exc:
            pool.give(parsed.state)
            raise ServiceError(ErrorCode.BAD_STATE, f"Unable to restore slot: {exc}") from exc
        return SeqFile(parsed.tokens, state), parsed.state, size


def _check_seq_file(path: Path, shape: seq_state.StateShape) -> list[int]:
    """The tokens of the ``ggsq`` file ``path`` once its header, token record and the state's structure
    (of ``shape``'s parts) check out."""
    with open(path, "rb") as f:
        tokens, _state_size = read_seq_head(f)
        seq_state.parse_file(f, f.tell(), shape=shape)
        return tokens


def _read_seq_file(path: Path, pool: BufferPool) -> tuple[SeqFile, int]:
    with open(path, "rb") as f:
        return pool.fill(lambda take: read_seq_file(f, take)), os.fstat(f.fileno()).st_size
