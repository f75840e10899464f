"""The llama.cpp context: one KV stream per sequence, attention captured in the graph.

:class:`Engine` owns the context, the batch buffer, the attention capture and the cell mirror,
and performs every operation on the KV cache, so the mirror (:mod:`engine.cellmap`) sees all of
them.  It is single-threaded: the worker's loop calls it between decode steps.

Why one file over 450 lines: every operation on the context (decode, truncate, fork, context shift, state save
and restore) changes the KV cache that the cell mirror must follow, and llama.cpp's context has one owner; the
byte formats it reads are in :mod:`slotstate`, the capture in :mod:`engine.capture`, batching in
:mod:`engine.batcher`, a decode's entries in :mod:`engine.batch`, the engine's exception in :mod:`engine.errors`,
and the start-up self-check that learns the state layout in :mod:`engine.self_check`.

KV layout (docs/architecture.md, "KV layout"): llama-server's default, ``kv_unified=false``:
every sequence has a KV stream of its own (``n_ctx`` cells), so a token attends over its own
sequence's cells only and the work per token follows its own context, however many other
conversations are resident.  A fork (``llama_memory_seq_cp`` across streams) copies the stream.

Sequence numbering: ``0..n_slots-1`` are addressed by the orchestrator (resident slots);
``n_slots..n_seq_max-1`` are spares for forks (previews).

States: llama.cpp writes a sequence's state with one record per stream (``include/llama.h``
``llama_state_seq_get_data``; all but the sequence's own empty); slotserve keeps and exchanges
the one-stream form (the record alone, as a unified cache writes it: :mod:`slotstate.seq_state`),
which does not depend on how many sequences this engine has and which llama-server reads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import llama_cpp as llama
import numpy as np

from contract.buffers import BufferPool
from contract.errors import ErrorCode
from contract.kv_types import KV_CACHE_TYPES
from contract.options import CaptureOptions
from contract.settings import FLASH_ATTN_TYPES, EngineSettings
from engine import backend, native
from engine.batch import BatchEntry
from engine.capture import AttentionCapture, CaptureError, RowTarget, seq_cells
from engine.cellmap import CellMap, CellMapError
from engine.errors import EngineError
from engine.kv_release import ReleaseSchedule
from engine.memory import UnsupportedMemoryError, memory_of
from engine.model import Model, file_fingerprint
from engine.self_check import run_self_check
from engine.state_read import StateSource, read_into
from slotstate import seq_state

State = bytearray | memoryview


class Engine:
    """A llama.cpp context over ``model`` (see the module docstring).

    Raises :class:`engine.model.ModelLoadError` / :class:`EngineError` when the context cannot
    be created, :class:`engine.native.PatchMissingError` on a libllama without slotserve's patch,
    and :class:`CaptureError` when the start-up self-check of the capture fails (:mod:`engine.self_check`).
    """

    def __init__(self, model: Model, config: EngineSettings, on_stage: Callable[[str], None] | None = None) -> None:
        report = on_stage or (lambda _stage: None)
        native.require_patch()
        self.model = model
        self.config = config
        n_seq = config.n_seq_max
        cp = llama.llama_context_default_params()
        cp.n_ctx = config.n_ctx_seq * n_seq
        cp.n_batch = config.n_batch
        cp.n_ubatch = config.n_ubatch
        cp.n_seq_max = n_seq
        cp.n_threads = config.n_threads
        cp.n_threads_batch = config.n_threads
        cp.kv_unified = False
        cp.swa_full = config.swa_full  # llama.cpp's default is true, llama-server's false
        self.flash_choice = backend.choose_flash_attn(config.flash_attn, config.n_gpu_layers, config.type_v)
        cp.flash_attn_type = FLASH_ATTN_TYPES[self.flash_choice.setting]
        cp.type_k, cp.type_v = KV_CACHE_TYPES[config.type_k], KV_CACHE_TYPES[config.type_v]
        cp.no_perf = True
        report("creating_context")
        ctx = llama.llama_init_from_model(model.ptr, cp)
        if not ctx:
            raise EngineError(
                ErrorCode.NO_MODEL, "llama.cpp could not create a context (a quantized V cache needs flash attention)"
            )
        self.ctx = ctx
        self.mem = llama.llama_get_memory(ctx)
        self.n_cells = llama.llama_n_ctx_seq(ctx)  # cells of each sequence's stream
        if self.n_cells < config.n_ctx:
            llama.llama_free(ctx)
            raise EngineError(
                ErrorCode.NO_MODEL, f"llama.cpp made {self.n_cells} KV cells per sequence, need {config.n_ctx}"
            )
        self.n_stream = n_seq
        try:
            self.memory = memory_of(ctx, model)
        except UnsupportedMemoryError as exc:
            llama.llama_free(ctx)
            raise EngineError(ErrorCode.NO_MODEL, str(exc)) from exc
        self.shape = self.memory.shape
        self.n_swa = llama.llama_model_n_swa(model.ptr) if self.shape.n_caches > 1 else 0
        self.cellmap = CellMap(self.n_cells)
        self.capture: AttentionCapture | None = None
        if config.capture and self.shape.n_caches:
            stable = backend.stable_capture_graph(config.n_gpu_layers, config.capture_graph)  # docs/gpu.md
            self.capture = AttentionCapture(
                ctx, self.cellmap, model.n_layer, self.shape.n_caches, verify=config.verify_cells, stable=stable
            )
        self.flash_attn = bool(native.lib.llama_attn_flash_attn(ctx))  # what llama.cpp made of the setting
        self.batch = llama.llama_batch_init(config.n_batch, 0, 1)
        n = config.n_batch  # numpy views of the batch's arrays (include/llama.h, llama_batch): a prefill chunk is
        self._tokens = np.ctypeslib.as_array(self.batch.token, shape=(n,))  # written with slice assignments
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(n,))
        self._n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n,))
        self._logits = np.ctypeslib.as_array(self.batch.logits, shape=(n,))
        self.tokens: dict[int, list[int]] = {}
        self.releases = ReleaseSchedule()  # emptied streams given back a few seconds later (engine/kv_release.py)
        # where states are read (save_state) and slot files land (engine/state_file.py); no state is kept
        # once its reader gave it back: the pool lets go of idle memory itself (contract/buffers.py)
        self.state_pool = BufferPool(keep=1)
        self.spare_free = list(range(config.n_slots, n_seq))
        self.embeddings_on = False
        self.fingerprint = file_fingerprint(model.path, cp.type_k, cp.type_v)
        self.type_k, self.type_v = int(cp.type_k), int(cp.type_v)
        report("self_check")
        self.layout = seq_state.StateLayout(())  # learned by the self-check, which restores with it
        self.self_check_ms = run_self_check(self)

    # ------------------------------------------------------------------ facts

    def seq_len(self, seq: int) -> int:
        """Tokens of ``seq`` with KV in the cache."""
        return len(self.tokens.get(seq, ()))

    @property
    def can_shift(self) -> bool:
        """Whether a sequence's positions can be shifted (:meth:`context_shift`): the memory can shift
        (``llama_memory_can_shift``) and holds no recurrent state (that holds the whole sequence)."""
        return self.memory.can_shift and not self.shape.recurrent

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with an attention row (all of a transformer's, a hybrid model's attention layers, none of a
        recurrent model's; none without capture)."""
        return self.capture.attention_layers if self.capture is not None else ()

    def layer_window(self, il: int) -> int:
        """Tokens layer ``il`` attends back over: llama.cpp's ``n_swa`` for a sliding-window layer (its
        row is 0 before the window), 0 for a global one."""
        return self.n_swa if self.capture is not None and self.capture.layer_cache[il] == 1 else 0

    # ------------------------------------------------------------------ decode

    def decode(self, entries: Sequence[BatchEntry]) -> int:
        """Run one ``llama_decode`` over ``entries``; capture their targets.

        The batch holds the entries in sequence order (llama.cpp puts consecutive sequences
        of a batch in one ubatch: ``llama_batch_allocr::split_equal``); each entry's
        ``batch_start`` says where its tokens are.  Updates the cell mirror and the sequences'
        token lists.  Returns llama.cpp's status (0 ok, 1 no room in the KV cache, 2 aborted,
        <0 error); on failure nothing of the batch stays in the cache or in the mirror.

        The entries must hold at most ``n_batch`` tokens together (``llama_batch_init`` made the batch
        that size: ``include/llama.h``); more raise ``EngineError(INTERNAL)`` before anything is
        written.  :meth:`decode_in_batches` splits a longer run of one sequence.
        """
        total = sum(len(e.tokens) for e in entries)
        if total > self.config.n_batch:
            raise EngineError(
                ErrorCode.INTERNAL, f"a batch of {total} tokens exceeds --batch-size {self.config.n_batch}"
            )
        b = self.batch
        i = 0
        targets: list[RowTarget] = []
        ordered = sorted(entries, key=lambda e: e.seq)
        for e in ordered:
            e.batch_start = i
            n = len(e.tokens)
            if n == 1:  # a decode step: scalar stores (a slice assignment costs more for one element)
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = e.tokens[0], e.pos0, 1, 0
            else:
                self._tokens[i : i + n] = e.tokens
                self._pos[i : i + n] = np.arange(e.pos0, e.pos0 + n, dtype=np.int32)
                self._n_seq_id[i : i + n] = 1
                self._logits[i : i + n] = 0
            for j in range(i, i + n):
                b.seq_id[j][0] = e.seq  # one pointer per token (llama_batch_init allocates each)
            if e.logits:
                b.logits[i + n - 1] = 1
            if e.target is not None:
                e.target.batch_index = i + n - 1
                targets.append(e.target)
            i += n
        b.n_tokens = i
        if self.capture is not None:
            self.capture.plan(targets)
        status = llama.llama_decode(self.ctx, b)
        if status != 0:
            self._rollback(ordered)
            return status
        try:
            for e in ordered:
                if len(e.tokens) and self.shape.n_caches:
                    cells = seq_cells(self.ctx, e.seq, e.pos0, len(e.tokens))
                    if cells.min() < 0:
                        raise CellMapError(f"seq {e.seq}: llama.cpp holds no cell for a decoded position")
                    self.cellmap.write(e.seq, e.pos0, cells)
            if self.capture is not None and targets:
                self.capture.collect(targets)
        except (CaptureError, CellMapError):
            self._rollback(ordered)
            raise
        for e in ordered:
            toks = self.tokens.setdefault(e.seq, [])
            del toks[e.pos0 :]
            toks.extend(e.tokens)
        return 0

    def decode_in_batches(self, entry: BatchEntry) -> int:
        """Decode one sequence's ``entry`` as consecutive batches of at most ``n_batch`` tokens (as
        llama-server prefills a prompt longer than ``--batch-size``); ``entry.logits`` and
        ``entry.target`` apply to its last token, in the last batch.  Returns llama.cpp's status (see
        :meth:`decode`); on a failure the batches before the failing one stay in the cache."""
        step = self.config.n_batch
        toks = entry.tokens
        for start in range(0, max(len(toks), 1), step):
            last = start + step >= len(toks)
            part = BatchEntry(
                entry.seq,
                entry.pos0 + start,
                toks[start : start + step],
                logits=entry.logits and last,
                target=entry.target if last else None,
            )
            status = self.decode([part])
            if status != 0:
                return status
            entry.batch_start = part.batch_start
        return 0

    def _rollback(self, entries: Sequence[BatchEntry]) -> None:
        for e in entries:
            if not llama.llama_memory_seq_rm(self.mem, e.seq, e.pos0, -1):
                self.erase(e.seq)  # a recurrent state cannot be taken back to an earlier position
                continue
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

    def new_target(self, seq: int, pos: int, cap: CaptureOptions | None = None) -> RowTarget:
        """A capture target for the token of ``seq`` at ``pos`` (``cap``: the request's format, dtype and
        layers; default every attention layer per head in float32): its ``out`` is filled by :meth:`decode`."""
        top_k = self.capture.max_top_k if self.capture is not None else 0
        return RowTarget.of(seq, pos, cap or CaptureOptions(attention=True), self.attention_layers, top_k)

    # ------------------------------------------------------------------ sequence operations

    def truncate(self, seq: int, n: int) -> None:
        """Keep the first ``n`` tokens of ``seq`` (``seq_rm(seq, n, -1)``).  Raises
        ``EngineError(INVALID_REQUEST)``, ``seq`` unchanged, where the model's memory cannot continue
        from there (:meth:`can_keep`)."""
        if n < self.seq_len(seq):
            if not self.can_keep(seq, n):
                raise EngineError(ErrorCode.INVALID_REQUEST, self.memory.no_partial_reason)
            self._cut(seq, n)

    def can_keep(self, seq: int, n: int) -> bool:
        """Whether ``seq`` can be cut to its first ``n`` tokens and continued exactly: always for a KV
        cache; for a sliding-window model only while its sliding cache still holds the window before
        position ``n`` (its cells are reused as the sequence moves on: llama-server re-processes the
        prompt then too); for a recurrent state only at its end or at 0.

        The window before position ``n`` is positions ``n - n_swa + 1`` to ``n - 1``: the next token, at
        position ``n``, sees a cell at ``p`` unless ``n - p >= n_swa`` (``is_masked_swa`` in llama.cpp's
        ``src/llama-hparams.h``; a chunked window starts at or after it). A sequence past its window whose
        sliding cache llama.cpp pruned to the window, or that a state restore placed there, can be cut by
        its last token (a resent prompt, which decodes that token again for its logits)."""
        have = self.seq_len(seq)
        if n >= have or n == 0:
            return True
        if self.shape.recurrent:
            return False
        if self.shape.n_caches > 1:
            lo = max(0, n - self.n_swa + 1)  # n_swa 1: the next token sees only itself
            return lo >= n or bool(seq_cells(self.ctx, seq, lo, n - lo, cache=1).min() >= 0)
        return True

    def keep(self, seq: int, n: int) -> int:
        """Cut ``seq`` to its first ``n`` tokens where that can be continued exactly (:meth:`can_keep`),
        else to none (the caller prefills again); returns the tokens kept."""
        if n >= self.seq_len(seq):
            return self.seq_len(seq)
        if n > 0 and self.can_keep(seq, n):
            return self._cut(seq, n)
        self.erase(seq, release=False)  # prefilled again at once
        return 0

    def _cut(self, seq: int, n: int) -> int:
        """``seq_rm(seq, n, -1)`` mirrored in the cell map and the token list; the whole sequence erased
        where llama.cpp refuses (a recurrent state).  Returns the tokens kept."""
        if not llama.llama_memory_seq_rm(self.mem, seq, n, -1):
            self.erase(seq, release=False)
            return 0
        self.cellmap.truncate(seq, n)
        del self.tokens[seq][n:]
        return n

    def erase(self, seq: int, release: bool = True) -> None:
        """Drop every cell of ``seq``; with ``release`` (where nothing refills it at once) give its KV
        stream's memory back a few seconds later if it is still empty then (:meth:`release_due`)."""
        llama.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.cellmap.remove(seq)
        self.tokens.pop(seq, None)
        if release:
            self.releases.schedule(seq)

    def release_due(self) -> int:
        """:meth:`release` of the erased sequences whose delay has passed and that hold no cells
        (:mod:`engine.kv_release`: the worker's loop calls this); returns the bytes given back."""
        return self.release(*(s for s in self.releases.due() if not self.tokens.get(s)))

    def release(self, *seqs: int) -> int:
        """Give the host memory of the KV streams of ``seqs`` (sequence ids in ``[0, n_stream)``) back to the
        kernel, each while its sequence holds no cells, in one call and one backend synchronization
        (``llama_attn_kv_seqs_release``, libllama/llama-attn.h: llama.cpp allocates and clears every stream
        when the context is made; the pages read back as zeros and are allocated again as cells are
        written, so resident KV follows the tokens held, not ``n_ctx``).  Returns the bytes given back: 0
        for no sequence, for sequences holding cells, a KV cache in GPU memory, a recurrent state."""
        if not seqs:
            return 0
        ids = (ctypes.c_int32 * len(seqs))(*seqs)
        return max(0, int(native.lib.llama_attn_kv_seqs_release(self.ctx, ids, len(seqs))))

    def release_empty(self) -> int:
        """:meth:`release` of every sequence holding no cells (after the start-up self-check, and by the idle
        worker: a K-shift writes the K of every stream, empty or not); returns the bytes given back."""
        self.releases.clear()
        return self.release(*(s for s in range(self.n_stream) if not self.tokens.get(s)))

    def reuse_chunks(self, seq: int, ids: Sequence[int], n_past: int, min_chunk: int) -> int:
        """llama-server's cache reuse (``n_cache_reuse``, ``tools/server/server-context.cpp``): after the
        first ``n_past`` tokens ``seq`` shares with ``ids``, every run of at least ``min_chunk`` tokens
        that ``ids`` continues with and the cache holds further on is moved into place by shifting
        its KV positions (``seq_rm`` of the cached tokens skipped before it, ``seq_add`` of the run),
        instead of being prefilled again.  Returns the tokens of ``ids`` the sequence now holds (its
        cells past them are dropped); ``n_past`` where the memory cannot shift (a recurrent state,
        two KV caches of different sizes), as llama-server disables it there.

        A moved run's K/V were computed under the old context (the tokens before it differ), so
        what follows attends to them as they were: fidelity figures in docs/api.md.
        """
        cached = self.tokens.get(seq, [])
        if min_chunk <= 0 or not self.memory.can_shift or self.shape.recurrent or n_past >= len(cached):
            return n_past
        head_c = head_p = n_past
        while head_c < len(cached) and head_p < len(ids):
            n = 0
            while head_c + n < len(cached) and head_p + n < len(ids) and cached[head_c + n] == ids[head_p + n]:
                n += 1
            if n < min_chunk:
                head_c += 1
                continue
            llama.llama_memory_seq_rm(self.mem, seq, head_p, head_c)
            llama.llama_memory_seq_add(self.mem, seq, head_c, head_c + n, head_p - head_c)
            self.cellmap.move(seq, head_c, head_p, n)
            cached[head_p : head_p + n] = cached[head_c : head_c + n]
            head_c += n
            head_p += n
        return self._cut(seq, head_p) if head_p > n_past else n_past

    def fork(self, src: int, dst: int) -> None:
        """Copy of ``src`` into ``dst`` (``seq_cp`` across streams: llama.cpp copies the stream's K/V
        buffers, cell for cell, so ``dst``'s cells are ``src``'s; done now rather than at the next
        decode, so that ``dst``'s state can be read at once; a recurrent state is copied when ``dst``
        first decodes)."""
        self.erase(dst, release=False)
        if self.seq_len(src):
            llama.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
            native.lib.llama_attn_memory_update(self.ctx)
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

    def context_shift(self, seq: int, n_keep: int, n_discard: int) -> int:
        """Remove ``n_discard`` tokens after ``n_keep`` and shift the rest down (llama-server's shift).

        Returns the new token count.  Raises ``EngineError(INVALID_REQUEST)`` for bad bounds, a KV
        cache that cannot shift positions (``llama_memory_can_shift``) or a recurrent state (it
        holds the whole sequence: nothing can be removed from its middle).
        """
        n = self.seq_len(seq)
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > n:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"need n_keep >= 0, n_discard > 0, n_keep + n_discard <= {n}")
        if not self.can_shift:
            reason = (
                self.memory.no_partial_reason
                if self.shape.recurrent
                else "this model's KV cache cannot shift positions"
            )
            raise EngineError(ErrorCode.INVALID_REQUEST, reason)
        llama.llama_memory_seq_rm(self.mem, seq, n_keep, n_keep + n_discard)
        llama.llama_memory_seq_add(self.mem, seq, n_keep + n_discard, -1, -n_discard)
        native.lib.llama_attn_memory_update(self.ctx)  # the K-shift now: a state read next must hold it
        self.release_empty()  # the K-shift wrote the K of every stream, the empty ones too
        self.cellmap.shift(seq, n_keep, n_discard)
        toks = self.tokens[seq]
        del toks[n_keep : n_keep + n_discard]
        return len(toks)

    # ------------------------------------------------------------------ states

    def save_state(self, seq: int) -> tuple[list[int], State]:
        """``(tokens, state)`` of ``seq``: its llama.cpp sequence state in the one-stream form
        (``u32 magic | i32 seq | u32 1 | record``, :mod:`slotstate.seq_state`), read now.

        Read with ``llama_state_seq_get_data`` into a buffer of :attr:`state_pool` and turned into the
        one-stream form in place (the 12 header bytes are written just before the sequence's record;
        the state is a view of the buffer, nothing copied).  The caller owns it (it stays as read
        whatever the sequence does next, and may be read on another thread) and hands it back with
        :meth:`release_state` once written out; one never handed back is freed with its last view.
        The engine keeps no copy.  Raises ``EngineError(INTERNAL)`` when llama.cpp's read fails.
        """
        _, state = read_state(self.ctx, seq, self.state_pool.take, self.state_pool.give, self.shape)
        return list(self.tokens.get(seq, ())), state

    def release_state(self, state: State) -> None:
        """Hand back a state from :meth:`save_state` that nothing reads any more: its memory serves the
        next read, or is freed once the pool finds it idle (thread-safe: a slot-file writer calls it)."""
        self.state_pool.give(state)

    def restore_state(
        self, seq: int, tokens: Sequence[int], blob: bytes | bytearray | memoryview, check_values: bool = False
    ) -> None:
        """Replace ``seq`` with ``tokens`` and their KV state; ``seq`` is untouched on refusal.

        ``blob`` is a sequence state as ``llama_state_seq_get_data`` writes it, of one stream or of
        several (llama-server's ``-np N``: one record per slot, all but one empty); it is read in
        place, never copied.  It is parsed and checked against this engine's layout before llama.cpp
        sees it, then restored by :meth:`restore_parsed`.  Raises ``EngineError(BAD_STATE)`` for a blob
        this engine cannot take and ``EngineError(CONTEXT_OVERFLOW)`` for more tokens than the
        context window (``n_ctx``).
        """
        try:
            parsed = seq_state.parse(blob, self.layout)
        except seq_state.BadStateError as exc:
            raise EngineError(ErrorCode.BAD_STATE, str(exc)) from exc
        self.restore_parsed(seq, tokens, parsed, StateSource.memory(blob), check_values)

    def restore_parsed(
        self,
        seq: int,
        tokens: Sequence[int],
        parsed: seq_state.ParsedState,
        src: StateSource,
        check_values: bool = False,
    ) -> None:
        """Replace ``seq`` with ``tokens`` and the state ``parsed`` (checked against :attr:`layout` by
        :func:`slotstate.seq_state.parse` or ``parse_file``), whose bytes are in ``src``
        (:func:`engine.state_read.read_into`: one pass, from memory or through a small buffer from a file).

        With ``check_values`` its float K/V values must be finite: a sequence holding no cells is
        restored while libllama tests them (a refusal leaves it empty, as it was); one holding cells
        has them tested first (:func:`slotstate.seq_state.check_finite`, ``src`` in memory only), so
        that a refusal leaves it as it was.  Raises ``EngineError(BAD_STATE)`` for a state whose
        positions, tokens or values this engine cannot take, ``EngineError(CONTEXT_OVERFLOW)`` for
        more tokens than ``n_ctx``; ``seq`` is untouched on refusal.
        """
        n = len(tokens)
        if n > self.config.n_ctx:
            raise EngineError(ErrorCode.CONTEXT_OVERFLOW, f"state of {n} tokens exceeds n_ctx {self.config.n_ctx}")
        self._check_positions(parsed, n)
        ids = np.asarray(tokens, dtype=np.int64)
        if n and (ids.min() < 0 or ids.max() >= self.model.n_vocab):
            raise EngineError(ErrorCode.BAD_STATE, "state tokens outside the vocabulary")
        if check_values and self.tokens.get(seq):  # cells to keep on a refusal: the values are tested first
            if src.blob is None:
                raise EngineError(ErrorCode.INTERNAL, "a file's values are tested before a restore only from memory")
            try:
                seq_state.check_finite(src.blob, parsed)
            except seq_state.BadStateError as exc:
                raise EngineError(ErrorCode.BAD_STATE, str(exc)) from exc
            check_values = False
        self.erase(seq, release=not n)
        if not n:
            return
        try:
            refused = read_into(self.ctx, seq, parsed, src, self.n_stream, check_values)
        except ValueError as exc:
            raise EngineError(ErrorCode.INTERNAL, str(exc)) from exc
        if refused:
            self.erase(seq)
            raise EngineError(ErrorCode.BAD_STATE, refused)
        if self.shape.n_caches:
            cells = seq_cells(self.ctx, seq, 0, n)
            if cells.min() < 0:
                self.erase(seq)
                raise EngineError(ErrorCode.INTERNAL, "llama.cpp restored a state without all of its positions")
            self.cellmap.set(seq, cells)
        self.tokens[seq] = list(tokens)

    def _check_positions(self, parsed: seq_state.ParsedState, n: int) -> None:
        """Refuse (``BAD_STATE``) a state whose cells do not hold the positions of ``n`` tokens: the
        global KV cache ``0..n-1`` each once, a sliding-window cache distinct positions among them, a
        recurrent state one cell at ``n-1``."""
        positions = parsed.positions  # the global KV cache's; a recurrent model's: its one cell's
        if not self.shape.n_caches:
            if n and (len(positions) != 1 or positions[0] != n - 1):
                raise EngineError(ErrorCode.BAD_STATE, f"the recurrent state is not at position {n - 1} of {n} tokens")
            return
        if len(positions) != n or not np.array_equal(np.sort(positions), np.arange(n)):
            raise EngineError(ErrorCode.BAD_STATE, f"state holds positions that are not 0..{n - 1} for {n} tokens")
        for extra in parsed.cache_positions[1:]:
            if len(extra) and (extra.min() < 0 or extra.max() >= n or len(np.unique(extra)) != len(extra)):
                raise EngineError(ErrorCode.BAD_STATE, f"the sliding-window cache holds positions outside 0..{n - 1}")

    def close(self) -> None:
        """Free the context and batch."""
        if self.ctx:
            llama.llama_batch_free(self.batch)
            llama.llama_free(self.ctx)
            self.ctx = None


def read_state(
    ctx: llama.llama_context_p,
    seq: int,
    alloc: Callable[[int], State] = bytearray,
    release: Callable[[State], None] = lambda _buf: None,
    shape: seq_state.StateShape | None = None,
) -> tuple[State, memoryview]:
    """``(buffer, state)``: ``llama_state_seq_get_data`` of ``seq`` written into ``alloc(size)``, and
    its one-stream form (:func:`slotstate.seq_state.one_stream`, a view of the buffer; ``shape``: the parts
    of the model's states, default one KV cache).  On failure the buffer goes to ``release`` and
    ``EngineError(INTERNAL)`` is raised."""
    size = llama.llama_state_seq_get_size(ctx, seq)
    raw = alloc(size)
    data = (ctypes.c_uint8 * size).from_buffer(raw)
    got = llama.llama_state_seq_get_data(ctx, data, size, seq)
    del data
    try:
        if got != size:
            raise EngineError(ErrorCode.INTERNAL, f"llama_state_seq_get_data wrote {got} of {size} bytes")
        return raw, seq_state.one_stream(raw, shape)
    except seq_state.BadStateError as exc:
        release(raw)
        raise EngineError(ErrorCode.INTERNAL, f"llama.cpp wrote a state slotserve cannot read: {exc}") from exc
    except EngineError:
        release(raw)
        raise
