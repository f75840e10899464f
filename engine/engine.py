"""The llama.cpp context: one unified KV cache shared by numbered sequences.

:class:`Engine` owns the context, the batch buffer, the attention capture and the
cell mirror, and performs every operation on the KV cache, so the mirror
(:mod:`engine.cellmap`) sees all of them.  It is single-threaded: the worker's loop
calls it between decode steps.

Sequence numbering: ``0..n_slots-1`` are addressed by the orchestrator (resident
slots); ``n_slots..n_seq_max-2`` are spares for forks (previews); the last one is the
scratch sequence for restores.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llama_cpp as llama
import numpy as np

from engine import ggml_ffi as g
from engine import seq_state
from engine.buffers import BufferPool
from engine.capture import AttentionCapture, RowTarget, Run
from engine.cellmap import CellMap
from engine.errors import ErrorCode
from engine.kv_io import StateReader, StateReadError, llama_state
from engine.kv_types import KV_CACHE_TYPES
from engine.model import Model, file_fingerprint
from engine.settings import EngineSettings


class EngineError(RuntimeError):
    """An operation failed, for the reason ``code`` (docs/api.md, "Errors")."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class BatchEntry:
    """Tokens of one sequence in a decode: ``tokens`` at positions ``pos0..``.

    ``target`` (optional) captures the attention row / mask of the last token;
    ``logits`` asks llama.cpp for the last token's logits.
    """

    seq: int
    pos0: int
    tokens: Sequence[int]
    logits: bool = False
    target: RowTarget | None = None
    batch_start: int = 0


class Engine:
    """A llama.cpp context over ``model`` with attention capture on every layer.

    Raises :class:`engine.model.ModelLoadError` / :class:`EngineError` when the
    context cannot be created and :class:`engine.ggml_ffi.GgmlLayoutError` when the
    start-up self-check of the capture fails.
    """

    def __init__(self, model: Model, config: EngineSettings, on_stage: Callable[[str], None] | None = None) -> None:
        report = on_stage or (lambda _stage: None)
        self.model = model
        self.config = config
        self.cellmap = CellMap(config.n_cells)
        self.capture = AttentionCapture(
            self.cellmap, model.n_layer, model.n_head, verify=config.verify_cells, use_c=config.eval_filter
        )
        cp = llama.llama_context_default_params()
        cp.n_ctx = config.n_cells
        cp.n_batch = config.n_batch
        cp.n_ubatch = config.n_ubatch
        cp.n_seq_max = config.n_seq_max
        cp.n_threads = config.n_threads
        cp.n_threads_batch = config.n_threads
        cp.kv_unified = True
        cp.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k, cp.type_v = KV_CACHE_TYPES[config.type_k], KV_CACHE_TYPES[config.type_v]
        if config.capture:
            cp.cb_eval, cp.cb_eval_user_data = self.capture.cb_eval
        cp.no_perf = True
        report("creating_context")
        ctx = llama.llama_init_from_model(model.ptr, cp)
        if not ctx:
            raise EngineError(ErrorCode.NO_MODEL, "llama.cpp could not create a context")
        self.ctx = ctx
        self.mem = llama.llama_get_memory(ctx)
        self.n_cells = llama.llama_n_ctx(ctx)
        if self.n_cells != config.n_cells:
            llama.llama_free(ctx)
            raise EngineError(ErrorCode.NO_MODEL, f"llama.cpp made {self.n_cells} KV cells, expected {config.n_cells}")
        self.batch = llama.llama_batch_init(config.n_batch, 0, 1)
        self.tokens: dict[int, list[int]] = {}
        # seq -> a copy of its current state (llama_state_seq_get_data), dropped when the sequence
        # changes; for the offloaded sequences (cells out of the cache) the only copy.  Dropped
        # copies go back to state_pool: the next read lands in memory already mapped (engine/buffers.py)
        self.states: dict[int, bytearray | memoryview] = {}
        self.state_pool = BufferPool(keep=1)
        self.lent: set[int] = set()  # ids of state buffers a thread other than the loop's still reads
        self.offloaded: set[int] = set()
        self.spare_free = list(range(config.n_slots, config.n_slots + config.n_spare))
        self.scratch = config.n_seq_max - 1
        self.embeddings_on = False
        self.fingerprint = file_fingerprint(model.path, cp.type_k, cp.type_v)
        self.type_k, self.type_v = int(cp.type_k), int(cp.type_v)
        self.reader = StateReader(ctx, verify=config.verify_cells)  # fast reads once the self-check agrees
        report("self_check")
        self.layout = self._self_check()

    # ------------------------------------------------------------------ facts

    def seq_len(self, seq: int) -> int:
        """Tokens of ``seq`` with KV in the cache."""
        return len(self.tokens.get(seq, ()))

    def free_cells(self) -> int:
        """KV cells no sequence holds (from the cell mirror; without capture, from token counts)."""
        if self.config.capture:
            return self.n_cells - int(np.count_nonzero(self.cellmap.occupied()))
        return self.n_cells - sum(len(t) for s, t in self.tokens.items() if s not in self.offloaded)

    def freed_by_truncate(self, seq: int, n: int) -> int:
        """KV cells that :meth:`truncate` ``(seq, n)`` would free: those of positions ``n..`` that no
        other sequence shares (e.g. a preview's fork)."""
        if not self.config.capture:
            return max(0, self.seq_len(seq) - n)
        return self.cellmap.private_cells(seq, n)

    def cell_runs(self, seq: int) -> int:
        """Runs of consecutive KV cells ``seq`` occupies; a large number when the mirror does not know
        (no capture)."""
        return self.cellmap.runs(seq) if self.config.capture else self.n_cells

    # ------------------------------------------------------------------ decode

    def decode(self, entries: Sequence[BatchEntry]) -> int:
        """Run one ``llama_decode`` over ``entries`` (in order); capture their targets.

        Updates the cell mirror and the sequences' token lists.  Returns llama.cpp's
        status (0 ok, 1 no room in the KV cache, 2 aborted, <0 error); on failure
        nothing of the batch stays in the cache or in the mirror.
        """
        b = self.batch
        i = 0
        runs: list[Run] = []
        targets: list[RowTarget] = []
        for e in entries:
            if e.seq in self.offloaded:
                raise EngineError(ErrorCode.INTERNAL, f"sequence {e.seq} is offloaded; make it resident first")
            self._drop_state(e.seq)
            e.batch_start = i
            n = len(e.tokens)
            for j, tok in enumerate(e.tokens):
                b.token[i + j] = tok
                b.pos[i + j] = e.pos0 + j
                b.n_seq_id[i + j] = 1
                b.seq_id[i + j][0] = e.seq
                b.logits[i + j] = 0
            if e.logits:
                b.logits[i + n - 1] = 1
            runs.append(Run(i, n, e.seq, e.pos0))
            if e.target is not None:
                e.target.batch_index = i + n - 1
                targets.append(e.target)
            i += n
        b.n_tokens = i
        self.capture.begin(runs, targets)
        try:
            status = llama.llama_decode(self.ctx, b)
        finally:
            try:
                self.capture.end()
            except Exception:
                self._rollback(entries)
                raise
        if status != 0:
            self._rollback(entries)
            return status
        for e in entries:
            if e.seq >= 0:
                toks = self.tokens.setdefault(e.seq, [])
                del toks[e.pos0 :]
                toks.extend(e.tokens)
        return 0

    def _rollback(self, entries: Sequence[BatchEntry]) -> None:
        for e in entries:
            llama.llama_memory_seq_rm(self.mem, e.seq, e.pos0, -1)
            self.cellmap.truncate(e.seq, e.pos0)

    def set_embeddings(self, on: bool) -> None:
        """Turn hidden-state output (``llama_get_embeddings_ith``) on or off for the next decodes."""
        if on != self.embeddings_on:
            llama.llama_set_embeddings(self.ctx, on)
            self.embeddings_on = on

    def hidden_state(self, batch_index: int) -> np.ndarray:
        """``float32[n_embd]``: the final hidden state of ``batch_index`` of the last decode."""
        ptr = llama.llama_get_embeddings_ith(self.ctx, batch_index)
        if not ptr:
            raise EngineError(ErrorCode.INTERNAL, "no hidden state for this token")
        arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.model.n_embd,))
        return arr.copy()

    def new_target(self, seq: int, pos: int, layers: Sequence[int] | None) -> RowTarget:
        """A capture target for the token of ``seq`` at ``pos``: ``out`` is ``float32[L, n_head, pos+1]``."""
        sel = np.arange(self.model.n_layer) if layers is None else np.asarray(layers, dtype=np.int64)
        slot = np.full(self.model.n_layer, -1, dtype=np.int64)
        slot[sel] = np.arange(len(sel))
        out = np.empty((len(sel), self.model.n_head, pos + 1), dtype=np.float32)
        return RowTarget(batch_index=-1, seq=seq, pos=pos, out=out, layer_slot=slot)

    # ------------------------------------------------------------------ sequence operations

    def truncate(self, seq: int, n: int) -> None:
        """Keep the first ``n`` tokens of ``seq`` (``seq_rm(seq, n, -1)``)."""
        if n < self.seq_len(seq):
            self.make_resident(seq)
            self._drop_state(seq)
            llama.llama_memory_seq_rm(self.mem, seq, n, -1)
            self.cellmap.truncate(seq, n)
            del self.tokens[seq][n:]

    def erase(self, seq: int) -> None:
        """Drop every cell of ``seq`` (and any copy of its state)."""
        self.offloaded.discard(seq)
        self._drop_state(seq)
        llama.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.cellmap.remove(seq)
        self.tokens.pop(seq, None)

    def fork(self, src: int, dst: int) -> None:
        """Copy-on-write copy of ``src`` into ``dst`` (``seq_cp``: cells shared, nothing copied)."""
        self.erase(dst)
        if self.seq_len(src):
            self.make_resident(src)
            llama.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
            self.cellmap.copy(src, dst)
            self.tokens[dst] = list(self.tokens[src])

    def take_spare(self) -> int:
        """A free spare sequence for a fork; raises ``EngineError(RATE_LIMITED)`` when none is left."""
        if not self.spare_free:
            raise EngineError(ErrorCode.RATE_LIMITED, "all spare sequences are in use by previews")
        return self.spare_free.pop()

    def give_spare(self, seq: int) -> None:
        """Discard a fork and return its sequence to the pool."""
        self.erase(seq)
        self.spare_free.append(seq)

    def offload(self, seq: int) -> int:
        """Move the cells of ``seq`` out of the KV cache into host memory; its tokens stay.

        What llama-server does with ``--cache-idle-slots`` on a unified cache: an idle
        slot's cells no longer widen every decode's attention (n_kv spans every used
        cell).  Any operation that needs the cells brings them back
        (:meth:`make_resident`).  Free when the state was saved since the sequence last
        changed (the write-behind save after a generation).  Returns the bytes of the
        state now held in host memory (0 if nothing moved).
        """
        if seq in self.offloaded or not self.seq_len(seq):
            return 0
        _, blob = self.save_state(seq)
        llama.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.cellmap.remove(seq)
        self.offloaded.add(seq)
        return len(blob)

    def make_resident(self, seq: int) -> None:
        """Restore an offloaded ``seq`` into the KV cache (:meth:`restore_state`); no-op otherwise.

        Raises ``EngineError(ErrorCode.OOM)`` when the cache has no room; ``seq`` stays offloaded.
        """
        if seq in self.offloaded:
            blob = self.states.pop(seq)  # held here: restore_state's erase must not recycle it
            try:
                self.restore_state(seq, self.tokens[seq], blob)
            finally:
                self.states[seq] = blob  # still the sequence's state (and its only copy if that failed)

    def context_shift(self, seq: int, n_keep: int, n_discard: int) -> int:
        """Remove ``n_discard`` tokens after ``n_keep`` and shift the rest down (llama-server's shift).

        Cells shared with another sequence (a fork) are first made private, because
        ``seq_add`` moves a shared cell for every sequence.  Returns the new token count.
        """
        n = self.seq_len(seq)
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > n:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"need n_keep >= 0, n_discard > 0, n_keep + n_discard <= {n}")
        if not llama.llama_memory_can_shift(self.mem):
            raise EngineError(ErrorCode.INVALID_REQUEST, "this model's KV cache cannot shift positions")
        self.make_resident(seq)
        if self.cellmap.sharers(seq):
            tokens, blob = self.save_state(seq)
            self.restore_state(seq, tokens, blob)
        self._drop_state(seq)
        llama.llama_memory_seq_rm(self.mem, seq, n_keep, n_keep + n_discard)
        llama.llama_memory_seq_add(self.mem, seq, n_keep + n_discard, -1, -n_discard)
        self.cellmap.shift(seq, n_keep, n_discard)
        toks = self.tokens[seq]
        del toks[n_keep : n_keep + n_discard]
        return len(toks)

    def _drop_state(self, seq: int) -> None:
        """Forget the copy of ``seq``'s state (it changed); its memory serves the next read, unless
        it is lent (:meth:`lend_state`): then it is freed once its reader lets go of it."""
        buf = self.states.pop(seq, None)
        if buf is not None:
            if id(buf) in self.lent:
                self.state_pool.drop(buf)
            else:
                self.state_pool.give(buf)

    def lend_state(self, seq: int) -> tuple[list[int], bytearray | memoryview]:
        """:meth:`save_state` for a reader on another thread: the buffer is not reused for another
        read until :meth:`end_lend` (which that thread may call), even if ``seq`` changes meanwhile."""
        tokens, buf = self.save_state(seq)
        self.lent.add(id(buf))
        return tokens, buf

    def end_lend(self, buf: bytearray | memoryview) -> None:
        """The reader of a buffer from :meth:`lend_state` is done with it (thread-safe)."""
        self.lent.discard(id(buf))

    def save_state(self, seq: int) -> tuple[list[int], bytearray | memoryview]:
        """``(tokens, llama.cpp sequence state)`` of ``seq`` (``llama_state_seq_get_data``).

        The state is kept until ``seq`` changes, so saving an unchanged sequence again (or
        offloading it) reads nothing; callers must not modify the returned buffer nor keep it past the
        sequence's next change (its memory is then reused for another read).
        """
        buf = self.states.get(seq)
        if buf is None:
            known = self.cellmap.length(seq) == self.seq_len(seq) and self.config.capture
            try:
                buf = self.reader.read(seq, self.cellmap.cells(seq) if known else None, self.state_pool.take)
            except StateReadError as exc:
                raise EngineError(ErrorCode.INTERNAL, str(exc)) from exc
            self.states[seq] = buf
        return list(self.tokens.get(seq, ())), buf

    def restore_state(
        self, seq: int, tokens: Sequence[int], blob: bytes | bytearray | memoryview, check_values: bool = False
    ) -> None:
        """Replace ``seq`` with ``tokens`` and their KV state; ``seq`` is untouched on failure.

        The blob (``llama_state_seq_get_data``'s format; read in place, never copied) is
        parsed and checked against this engine's layout (with ``check_values``, its float
        K/V values must also be finite: :func:`engine.seq_state.check_finite`), then
        ``llama_state_seq_set_data`` puts it in place (:meth:`_place`).  Raises
        ``EngineError(ErrorCode.BAD_STATE)`` for a blob this engine cannot take, and
        ``EngineError(ErrorCode.CONTEXT_OVERFLOW)`` for more tokens than the context window
        (``n_ctx``).
        """
        try:
            parsed = seq_state.parse(blob, self.layout)
            if check_values:
                seq_state.check_finite(blob, parsed)
        except seq_state.BadStateError as exc:
            raise EngineError(ErrorCode.BAD_STATE, str(exc)) from exc
        self._place(seq, tokens, parsed.positions, blob)

    def _place(
        self, seq: int, tokens: Sequence[int], positions: np.ndarray, blob: bytes | bytearray | memoryview
    ) -> None:
        """Replace ``seq`` with ``tokens`` and the parsed, checked state ``blob``; ``seq`` is untouched on failure.

        ``positions`` (``int32[n]``) is the position of each cell in the state's order; it must
        be a permutation of ``0..n-1`` for ``n = len(tokens)``.  ``llama_state_seq_set_data``
        writes the state into the empty scratch sequence, whose cells llama.cpp chooses as
        :meth:`_restore_cells` names them; the scratch is then moved to ``seq``
        (``llama_memory_seq_cp``: no copy of the K/V bytes).  Raises
        ``EngineError(ErrorCode.BAD_STATE)`` (positions, tokens outside the vocabulary, a state
        llama.cpp refuses) and ``EngineError(ErrorCode.CONTEXT_OVERFLOW)`` (more tokens than ``n_ctx``).
        """
        n = len(tokens)
        if n > self.config.n_ctx:
            raise EngineError(ErrorCode.CONTEXT_OVERFLOW, f"state of {n} tokens exceeds n_ctx {self.config.n_ctx}")
        if len(positions) != n or not np.array_equal(np.sort(positions), np.arange(n)):
            raise EngineError(ErrorCode.BAD_STATE, f"state holds positions that are not 0..{n - 1} for {n} tokens")
        ids = np.asarray(tokens, dtype=np.int64)
        if n and (ids.min() < 0 or ids.max() >= self.model.n_vocab):
            raise EngineError(ErrorCode.BAD_STATE, "state tokens outside the vocabulary")
        s = self.scratch
        self.erase(s)
        if n:
            cells = self._restore_cells(n)
            data = np.frombuffer(blob, dtype=np.uint8)  # read in place, writable or not
            src = ctypes.cast(data.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
            if llama.llama_state_seq_set_data(self.ctx, src, data.nbytes, s) != data.nbytes:
                self.erase(s)
                raise EngineError(ErrorCode.BAD_STATE, "llama.cpp refused the sequence state")
            if cells is not None:
                pos2cell = np.empty(n, dtype=np.int32)
                pos2cell[positions] = cells
                self.cellmap.set(s, pos2cell)
            self.tokens[s] = list(tokens)
        self.erase(seq)
        if n:
            llama.llama_memory_seq_cp(self.mem, s, seq, -1, -1)
            self.cellmap.copy(s, seq)
            self.tokens[seq] = list(tokens)
        self.erase(s)

    def _restore_cells(self, n: int) -> np.ndarray | None:
        """The cells the next ``llama_state_seq_set_data`` of ``n`` cells gives them, in the blob's order.

        llama.cpp's ``state_read_meta`` (``src/llama-kv-cache.cpp``) places a state's cells with
        ``find_slot(ubatch, cont=false)``: the free cells met scanning from the cache's head,
        wrapping at its end, in the blob's order.  ``seq_add`` on the empty scratch sequence
        sets the head to cell 0 (``seq_add`` resets it when no cell moved), so they are the
        first ``n`` free cells of the mirror.  ``None`` without capture (no mirror is kept).
        Raises ``EngineError(ErrorCode.OOM)`` when fewer than ``n`` cells are free, and
        ``EngineError(ErrorCode.INVALID_REQUEST)`` for a cache that cannot shift positions.
        """
        if not self.config.capture:
            return None
        if not llama.llama_memory_can_shift(self.mem):
            raise EngineError(
                ErrorCode.INVALID_REQUEST, "restoring with attention capture needs a KV cache that can shift"
            )
        free = np.flatnonzero(~self.cellmap.occupied())[:n]
        if len(free) < n:
            raise EngineError(ErrorCode.OOM, f"no room in the KV cache for a state of {n} cells")
        llama.llama_memory_seq_add(self.mem, self.scratch, 0, -1, 1)
        return free.astype(np.int32)

    # ------------------------------------------------------------------ start-up

    def _self_check(self) -> seq_state.StateLayout:
        """Check the capture on a real decode and learn this engine's state layout.

        Decodes three tokens on the scratch sequence capturing the last row: every
        ``kq_soft_max`` node must be seen with the expected shape and each row must sum
        to 1.  Raises :class:`engine.ggml_ffi.GgmlLayoutError` otherwise.
        """
        s = self.scratch
        toks = self.model.tokenize("Hello world", False, False)[:3] or [0, 0, 0]
        target = self.new_target(s, len(toks) - 1, None) if self.config.capture else None
        t0 = time.perf_counter()
        status = self.decode([BatchEntry(s, 0, toks, logits=True, target=target)])
        if status != 0:
            raise g.GgmlLayoutError(f"self-check decode failed with status {status}")
        seen = self.capture.n_softmax_seen
        sums = target.out.sum(axis=-1) if target is not None and target.out is not None else np.ones(1)
        if target is not None and (seen != self.model.n_layer or not np.allclose(sums, 1.0, atol=1e-3)):
            raise g.GgmlLayoutError(
                f"attention capture self-check failed: {seen} softmax nodes, row sums {sums.ravel()[:4]}"
            )
        blob = llama_state(self.ctx, s)
        layout = seq_state.parse(blob).layout
        if self.config.capture:
            self.reader.enable(self.capture.k_cache, layout, self.n_cells, s, self.cellmap.cells(s))
        self.erase(s)
        self.self_check_ms = (time.perf_counter() - t0) * 1000
        return layout

    def close(self) -> None:
        """Free the context and batch."""
        if self.ctx:
            llama.llama_batch_free(self.batch)
            llama.llama_free(self.ctx)
            self.ctx = None
