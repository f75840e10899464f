"""Continuous batching: every active generation shares each ``llama_decode``.

One :meth:`Batcher.step` builds one batch from all active jobs (one decode token per
generating job, then prefill chunks within ``n_batch``), decodes it, samples each
job with its llama.cpp sampler chain, and emits a ``Token`` (with its attention
row, gathered into input-position order) per generated token.  A finished
generation's last sampled token is written to the KV cache in the next step (a
"commit"), so a slot always holds ``input_ids + generated``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from contract.errors import ErrorCode
from contract.flow import Credit
from contract.options import SamplingParams
from contract.protocol import Buffer, Done, Error, FinishReason, Generate, Message, Progress, Tensor, Token
from contract.reduction import reduction_error
from engine.batch import BatchEntry
from engine.engine import Engine
from engine.errors import EngineError
from engine.grammar import GrammarError
from engine.reasoning_budget import ReasoningBudget
from engine.sampling import NO_TOKEN, SamplerChain, logits_row, logprobs

Emit = Callable[[Message, Sequence[Buffer]], None]
PROGRESS_EVERY = 256  # prompt tokens between two Progress events of a job that asks for them


@dataclass
class Job:
    """One generation: its sequence, what is left to prefill, and what it produced."""

    req: Generate
    seq: int
    fork: bool
    pending: list[int]
    n_cached: int
    chain: SamplerChain
    n_prompt: int
    generated: list[int] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    last: int = -1
    cancelled: bool = False
    credit: Credit = field(default_factory=Credit)  # flow control: emitted against taken (``Ack``)
    n_prefilled: int = 0
    t0: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    n_discarded: int = 0  # tokens context shifts dropped (Generate.n_keep)
    shift: tuple[int, int] | None = None  # the last shift, reported on the next Token


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class Batcher:
    """Active generations over one :class:`Engine`; call :meth:`step` while :meth:`has_work`."""

    def __init__(self, engine: Engine, emit: Emit) -> None:
        self.engine = engine
        self.emit = emit
        self.jobs: dict[int, Job] = {}
        self.commits: dict[int, int] = {}  # seq -> last token still to write to the KV cache

    @property
    def shifts(self) -> bool:
        """Whether a full generation shifts its window (``--context-shift`` on a memory that can shift)."""
        return self.engine.config.context_shift and self.engine.can_shift

    # ------------------------------------------------------------------ admission

    def busy(self, seq: int) -> bool:
        """True while a ``generate`` job owns ``seq``."""
        return any(j.seq == seq and not j.fork for j in self.jobs.values())

    def submit(self, req: Generate) -> None:
        """Admit a generation or emit an ``Error`` with ``refused`` set (SLOT_BUSY, CONTEXT_OVERFLOW,
        NO_CACHED_CONTEXT, OOM: no room in the KV cache for the prompt...): a refused request
        leaves its sequence's tokens and cells as they were."""
        try:
            chain = self.new_chain(req.params)  # before the sequence changes: a bad grammar leaves it as it was
        except EngineError as exc:
            self.emit(Error(req.req, exc.code, exc.message, refused=True), ())
            return
        try:
            job = self._admit(req, chain)
        except EngineError as exc:
            chain.close()
            self.emit(Error(req.req, exc.code, exc.message, refused=True), ())
            return
        self.jobs[req.req] = job
        if req.progress and job.pending:
            self._progress(job)
        if not job.pending and req.params.max_new_tokens == 0:
            self._finish(job, "length")

    def new_chain(self, params: SamplingParams) -> SamplerChain:
        """The sampler chain of ``params`` (with its thinking budget, :mod:`engine.reasoning_budget`);
        ``EngineError`` (``INVALID_GRAMMAR``) when its grammar is unusable."""
        model = self.engine.model
        budget = None
        if params.reasoning_budget >= 0 and params.reasoning_start and params.reasoning_end:
            forced = model.tokenize(params.reasoning_message, False, True) if params.reasoning_message else []
            forced += model.tokenize(params.reasoning_end, False, True)
            start, end = params.reasoning_start.encode(), params.reasoning_end.encode()
            budget = ReasoningBudget(start, end, forced, params.reasoning_budget, params.reasoning_open, model.pieces)
        try:
            return SamplerChain(params, model.vocab, model.n_vocab, budget)
        except GrammarError as exc:
            raise EngineError(exc.code, str(exc)) from exc

    def _admit(self, req: Generate, chain: SamplerChain) -> Job:
        eng = self.engine
        n_ctx = eng.config.n_ctx
        p = req.params
        if req.capture.attention and not eng.config.capture:
            raise EngineError(ErrorCode.INVALID_REQUEST, "this engine runs without attention capture")
        if req.capture.attention and not eng.attention_layers:
            raise EngineError(ErrorCode.INVALID_REQUEST, "this model has no attention layers (recurrent)")
        n_input = len(req.input_ids) if req.mode == "generate" else n_ctx  # a preview's spans: the orchestrator's
        bad = reduction_error(req.capture, eng.model.n_head, n_ctx, n_input)
        if bad is not None:
            raise EngineError(ErrorCode.INVALID_REQUEST, bad)
        if req.mode == "generate":
            if not 0 <= req.seq < eng.config.n_slots:
                raise EngineError(ErrorCode.INVALID_REQUEST, f"no engine sequence {req.seq}")
            if self.busy(req.seq):
                raise EngineError(ErrorCode.SLOT_BUSY, f"sequence {req.seq} is generating")
            if self.shifts:  # the prompt must fit; the generation shifts the window when it fills it
                if len(req.input_ids) >= n_ctx:
                    raise EngineError(ErrorCode.CONTEXT_OVERFLOW, f"{len(req.input_ids)} tokens >= n_ctx {n_ctx}")
            elif len(req.input_ids) + p.max_new_tokens > n_ctx:
                raise EngineError(
                    ErrorCode.CONTEXT_OVERFLOW, f"{len(req.input_ids)} + {p.max_new_tokens} tokens > n_ctx {n_ctx}"
                )
            if not req.input_ids:
                raise EngineError(ErrorCode.INVALID_REQUEST, "input_ids is empty")
            self.flush(req.seq)
            common = common_prefix(eng.tokens.get(req.seq, []), req.input_ids)
            reuse = eng.config.cache_reuse if req.cache_reuse is None else req.cache_reuse
            common = eng.reuse_chunks(req.seq, req.input_ids, common, reuse)
            if common == len(req.input_ids) and p.max_new_tokens > 0:
                common -= 1  # the last token is decoded again for its logits
            common = eng.keep(req.seq, common)  # less (0) where the memory cannot continue from there
            seq, fork, pending, history = req.seq, False, list(req.input_ids[common:]), req.input_ids
        else:  # preview
            base: list[int] = []
            if req.seq >= 0:
                self.flush(req.seq)
                base = eng.tokens.get(req.seq, [])
            if not base and not req.input_ids:
                raise EngineError(ErrorCode.NO_CACHED_CONTEXT, "No cached context available")
            pending = list(req.append) if base else list(req.input_ids) + list(req.append)
            if len(base) + len(pending) + p.max_new_tokens > n_ctx:
                raise EngineError(
                    ErrorCode.CONTEXT_OVERFLOW,
                    f"{len(base) + len(pending)} + {p.max_new_tokens} tokens > n_ctx {n_ctx}",
                )
            if not base and not pending:
                raise EngineError(ErrorCode.INVALID_REQUEST, "nothing to generate from")
            seq, fork = eng.take_spare(), True
            if base:
                eng.fork(req.seq, seq)
            common, history = len(base), [*base, *pending]
            if not pending and p.max_new_tokens > 0:
                # Nothing appended: the fork decodes the slot's last token again for its
                # logits (llama-server does the same when the whole prompt is cached).
                # seq_rm on the fork alone drops its reference; the slot keeps the cell.
                common = eng.keep(seq, common - 1)  # a recurrent state: 0, the whole base again
                pending = base[common:]
        chain.accept_history(history)
        credit = Credit(req.window, req.window_bytes)
        return Job(req, seq, fork, pending, common, chain, n_prompt=common + len(pending), credit=credit)

    def ack(self, req: int, n: int) -> None:
        """The client of ``req`` has taken its first ``n`` tokens (``Ack``); a held job may go on."""
        job = self.jobs.get(req)
        if job is not None:
            job.credit.ack(n)

    @staticmethod
    def held(job: Job) -> bool:
        """True while ``job`` has run its flow-control window (``Generate.window`` tokens, or
        ``window_bytes`` of tensors) ahead of what its client has taken (:class:`contract.flow.Credit`):
        it is not decoded (its sequence waits) until an ``Ack`` or a cancel."""
        return job.credit.spent() and not job.cancelled

    def cancel(self, req: int) -> None:
        """Mark ``req`` cancelled; it ends with ``Done(finish_reason="cancelled")`` at the next step."""
        job = self.jobs.get(req)
        if job is not None:
            job.cancelled = True

    def has_work(self) -> bool:
        """Anything for :meth:`step` to do: a job to decode or to end.  Pending commits alone are not:
        each is written with the next step's batch, by :meth:`flush` when an operation on its sequence
        needs it, or by the idle worker shortly after (``engine.worker.COMMIT_DELAY_S``), so that a
        strict turn's save, which does not wait for them, comes first.

        The worker blocks on its inbox while this is false, so it never spins.
        """
        return any(j.cancelled or ((j.last >= 0 or j.pending) and not self.held(j)) for j in self.jobs.values())

    def flush(self, seq: int | None = None) -> None:
        """Write pending commits (of ``seq``, or all) to the KV cache now."""
        todo = {s: t for s, t in self.commits.items() if seq is None or s == seq}
        if not todo:
            return
        entries = [BatchEntry(s, self.engine.seq_len(s), [t]) for s, t in todo.items()]
        for s in todo:
            self.commits.pop(s, None)
        # On failure (no room) the token is simply not stored: the slot keeps what it has
        # and the next request on it prefills that token again.
        step = self.engine.config.n_batch  # more sequences than --batch-size: several decodes
        for k in range(0, len(entries), step):
            self.engine.decode(entries[k : k + step])

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        """One decode over every active job; emits tokens and finished generations."""
        for job in [j for j in self.jobs.values() if j.cancelled]:
            self._finish(job, "cancelled")
        eng = self.engine
        budget = eng.config.n_batch
        entries: list[BatchEntry] = []
        owners: list[Job | None] = []
        for s, tok in list(self.commits.items()):
            if self.busy(s):
                del self.commits[s]
            elif budget > 0:  # the rest wait for the next step
                del self.commits[s]
                entries.append(BatchEntry(s, eng.seq_len(s), [tok]))
                owners.append(None)
                budget -= 1
        for job in list(self.jobs.values()):
            if job.last >= 0 and budget > 0 and not self.held(job) and self._room(job):
                entries.append(self._entry(job, [job.last], True))
                owners.append(job)
                budget -= 1
        for job in self.jobs.values():
            if job.last < 0 and job.pending and budget > 0:
                chunk = job.pending[: min(budget, PROGRESS_EVERY) if job.req.progress else budget]
                last = len(chunk) == len(job.pending)
                entries.append(self._entry(job, chunk, last and job.req.params.max_new_tokens > 0))
                owners.append(job)
                budget -= len(chunk)
        if not entries:
            return
        eng.set_embeddings(any(o is not None and o.req.capture.hidden_state for o in owners))
        try:
            status = eng.decode(entries)
        except Exception as exc:  # capture or mirror failure: fail the jobs of this batch
            for o in {id(o): o for o in owners if o is not None}.values():
                self._fail(o, ErrorCode.INTERNAL, f"decode failed: {exc}")
            return
        if status != 0:
            self._decode_failed(status, entries, owners)
            return
        for e, owner in zip(entries, owners, strict=True):
            if owner is None:
                continue
            if owner.last < 0:
                del owner.pending[: len(e.tokens)]
                owner.n_prefilled += len(e.tokens)
                if owner.req.progress:
                    self._progress(owner)
                if not owner.pending and owner.req.params.max_new_tokens == 0:
                    self._finish(owner, "length")
                    continue
            if e.logits:
                self._sample(owner, e)

    def _room(self, job: Job) -> bool:
        """Make room in ``job``'s window for its next token; False when it ended instead.

        llama-server's rule (``server_context::pre_decode``, tools/server/server-context.cpp): once
        the sequence's tokens + 1 reach the window, drop ``n_discard`` tokens after the first
        ``n_keep`` (the request's, or half of the rest) and shift the later ones down
        (:meth:`Engine.context_shift`).  Only a ``generate`` job shifts (a preview's fork shares its
        slot's cells); without ``--context-shift`` admission keeps every job within its window.
        """
        eng = self.engine
        n_ctx, n = eng.config.n_ctx, eng.seq_len(job.seq)
        if n + 1 < n_ctx or not self.shifts or job.fork:
            return True
        n_keep = job.n_prompt if job.req.n_keep < 0 else job.req.n_keep
        n_keep = min(n_ctx - 4, n_keep + (1 if eng.model.add_bos else 0))
        n_left = n - n_keep
        n_discard = min(job.req.n_discard or n_left // 2, max(0, n_left - 1))
        if n_discard <= 0:  # nothing left to drop: end as at the window
            self._finish(job, "length")
            return False
        eng.context_shift(job.seq, n_keep, n_discard)
        job.n_discarded += n_discard
        job.shift = (n_keep, n_discard)
        return True

    def _progress(self, job: Job) -> None:
        """Emit ``Progress``: prompt tokens in the KV cache (cached + prefilled) of ``n_prompt``."""
        t_ms = (time.perf_counter() - job.t0) * 1000
        self.emit(Progress(job.req.req, job.n_prompt, job.n_cached, job.n_cached + job.n_prefilled, t_ms), ())

    def _entry(self, job: Job, tokens: list[int], logits: bool) -> BatchEntry:
        pos0 = self.engine.seq_len(job.seq)
        target = None
        cap = job.req.capture
        if logits and cap.attention:
            target = self.engine.new_target(job.seq, pos0 + len(tokens) - 1, cap)
        return BatchEntry(job.seq, pos0, tokens, logits=logits, target=target)

    def _sample(self, job: Job, e: BatchEntry) -> None:
        eng = self.engine
        p = job.req.params
        idx = e.batch_start + len(e.tokens) - 1
        logits = logits_row(eng.ctx, idx, eng.model.n_vocab) if (p.logprobs or p.n_probs) else None
        tok = job.chain.sample(eng.ctx, idx)
        if tok == NO_TOKEN:  # the grammar allows nothing more: end as at an end-of-generation token
            job.last = -1  # decoded in this step already
            self._finish(job, "stop_token")
            return
        if not job.t_first:
            job.t_first = time.perf_counter()
        post = job.chain.keep_candidates  # llama-server's post_sampling_probs: top_probs instead of top
        lp, top = logprobs(logits, tok, 0 if post else p.n_probs) if logits is not None else (None, [])
        prob, top_probs = job.chain.post_probs(p.n_probs) if post else (None, [])
        buffers: list[np.ndarray] = []
        attention = hidden = positions = None
        sink = e.target.sink if e.target is not None else None
        if e.target is not None and e.target.out is not None:
            buffers.append(e.target.out)
            attention = Tensor.of(buffers[-1], len(buffers) - 1)
            if e.target.positions is not None:
                buffers.append(e.target.positions)
                positions = Tensor.of(buffers[-1], len(buffers) - 1)
        if job.req.capture.hidden_state:
            buffers.append(eng.hidden_state(idx))
            hidden = Tensor.of(buffers[-1], len(buffers) - 1)
        piece = eng.model.pieces[tok]
        index = len(job.generated)
        job.generated.append(tok)
        job.text += piece
        n_ctx = e.pos0 + len(e.tokens)
        self.emit(
            Token(
                job.req.req,
                index,
                tok,
                piece,
                lp,
                top,
                n_ctx,
                attention,
                hidden,
                job.shift,
                prob,
                top_probs,
                attention_pos=positions,
                sink=sink,
            ),
            [b.data for b in buffers],
        )
        job.shift = None
        job.credit.emit(sum(b.nbytes for b in buffers))
        reason, stop = self._stop_reason(job, tok)
        job.last = tok
        if reason is not None:
            self._finish(job, reason, stop)

    def _stop_reason(self, job: Job, tok: int) -> tuple[FinishReason | None, str]:
        p = job.req.params
        if tok in p.stop_tokens or (not p.ignore_eos and tok in self.engine.model.eog):
            return "stop_token", ""
        for s in p.stop_strings:
            b = s.encode()
            if b and b in job.text[-(len(b) + len(self.engine.model.pieces[tok])) :]:
                return "stop_string", s
        if len(job.generated) >= p.max_new_tokens:
            return "length", ""
        return None, ""

    def _finish(self, job: Job, reason: FinishReason, stop: str = "") -> None:
        self.jobs.pop(job.req.req, None)
        job.chain.close()
        n_seq = self.engine.seq_len(job.seq)
        if job.fork:
            self.engine.give_spare(job.seq)
        elif job.last >= 0:
            self.commits[job.seq] = job.last
            n_seq += 1
        now = time.perf_counter()
        t_first = job.t_first or now
        self.emit(
            Done(
                job.req.req,
                reason,
                n_prompt=job.n_prompt,
                n_cached=job.n_cached,
                n_prefilled=job.n_prefilled,
                n_generated=len(job.generated),
                t_prefill_ms=(t_first - job.t0) * 1000,
                t_generate_ms=(now - t_first) * 1000,
                stop_string=stop,
                seq_tokens=0 if job.fork else n_seq,
                n_discarded=job.n_discarded,
                truncated=job.n_discarded > 0 or n_seq >= self.engine.config.n_ctx,
            ),
            (),
        )

    def _fail(self, job: Job, code: ErrorCode, message: str) -> None:
        self.jobs.pop(job.req.req, None)
        job.chain.close()
        if job.fork:
            self.engine.give_spare(job.seq)
        self.emit(Error(job.req.req, code, message), ())

    def _decode_failed(self, status: int, entries: list[BatchEntry], owners: list[Job | None]) -> None:
        jobs = [o for o in owners if o is not None]
        if status == 1 and any(o.last < 0 for o in jobs):
            # No room in the KV cache: drop the biggest prefill and let the rest retry.
            victim = max((o for o in jobs if o.last < 0), key=lambda o: len(o.pending))
            self._fail(victim, ErrorCode.OOM, "the KV cache is full")
            return
        for o in {id(o): o for o in jobs}.values():
            self._fail(
                o, ErrorCode.OOM if status == 1 else ErrorCode.INTERNAL, f"llama_decode failed with status {status}"
            )
