"""Generation service: validate a request, run it on its slot, yield wire-neutral events.

HTTP/SSE/WS handlers call :meth:`GenerationService.run` and only format what it
yields (:class:`TokenOut` per generated token, then one :class:`DoneOut`).  Data flows
one way: handler -> slot registry -> engine client -> worker -> events back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import structlog

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.options import CaptureOptions, SamplingParams
from orchestrator import metrics
from orchestrator.engine_client.interface import EngineClient, EngineRequestError, GenerationJob, GenerationStream
from orchestrator.generation.capture import capture_options, check_reduction, require_attention
from orchestrator.generation.events import (
    DoneOut,
    PreviewStarted,
    ProgressOut,
    Started,
    TokenOut,
    TokenStream,
    TokenWatcher,
)
from orchestrator.generation.request import AppendToken, CanonicalRequest, PreviewRequest
from orchestrator.generation.stall import StallGuard, park_stalled
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import WaitHooks
from orchestrator.slots.anonymous import DEFAULT_SLOT, AnonymousSlots, keyed_id
from orchestrator.slots.model import Slot, partition_of
from orchestrator.slots.registry import SlotRegistry, check_slot_id
from orchestrator.slots.residency import uncancellable
from orchestrator.tenants.limits import TenantLimits
from orchestrator.tenants.principal import DEFAULT_PRINCIPAL, Principal
from orchestrator.tokens import check_tokens

log = structlog.get_logger("slotserve.generate")


PASSED_ON = ("presence_penalty", "frequency_penalty", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
             "dry_multiplier", "dry_allowed_length", "dry_sequence_breakers", "dynatemp_range", "dynatemp_exponent",
             "mirostat", "mirostat_tau", "mirostat_eta", "grammar", "json_schema",
             "schema_rule", "grammar_triggers", "post_sampling_probs", "reasoning_budget", "reasoning_start",
             "reasoning_end", "reasoning_message", "reasoning_open")  # fmt: skip
"""The further sampler settings a :class:`CanonicalRequest` hands to the engine as they are."""


def sampling_params(req: CanonicalRequest, info: proto.ModelInfo) -> SamplingParams:
    """Validated :class:`contract.options.SamplingParams` from a canonical request.

    Value ranges are checked when the body is decoded (``orchestrator/schemas.py``); this
    checks token ids against the vocabulary and resolves llama-server's special values
    (``repeat_last_n`` and ``dry_penalty_last_n`` -1: the context size; ``top_k`` <= 0 and
    ``repeat_penalty`` 0: off; ``dry_base`` below 1: its default).
    """
    vocab_size = info.vocab_size
    check_tokens(req.stop_tokens, vocab_size, "stop_tokens")
    check_tokens(req.banned_tokens, vocab_size, "banned_tokens")
    bias = [(t, b) for t, b in req.logit_bias if isinstance(t, int)]  # texts: see GenerationService.resolve_bias
    check_tokens([t for t, _ in bias], vocab_size, "logit_bias")
    return SamplingParams(
        max_new_tokens=req.max_new_tokens,
        temperature=req.temperature,
        top_k=max(0, req.top_k),
        top_p=req.top_p,
        min_p=req.min_p,
        repeat_penalty=req.repeat_penalty if req.repeat_penalty > 0 else 1.0,
        repeat_last_n=info.n_ctx if req.repeat_last_n == -1 else req.repeat_last_n,
        seed=req.seed,
        banned_tokens=req.banned_tokens,
        stop_tokens=req.stop_tokens,
        stop_strings=req.stop_strings,
        ignore_eos=req.ignore_eos,
        n_probs=req.n_probs,
        logprobs=req.token_logprobs,
        dry_base=req.dry_base if req.dry_base >= 1.0 else SamplingParams().dry_base,  # llama-server's rule
        dry_penalty_last_n=info.n_ctx if req.dry_penalty_last_n == -1 else req.dry_penalty_last_n,
        logit_bias=bias,
        **{name: getattr(req, name) for name in PASSED_ON},
    )


class RunControl:
    """Lets a handler cancel the generation a :meth:`GenerationService.run` started.

    ``on_queued(position)`` is awaited while the request waits for a free engine
    sequence (1 = next; see :mod:`orchestrator.slots.admission`); cancelling a queued request
    ends its wait (``CLIENT_GONE``) and frees its place.  ``watched``: a handler watches the
    client for a disconnect on its behalf (``orchestrator.api.common.run.cancelled_on_disconnect``).
    ``slot_id``: the slot the request uses, known as soon as it is chosen (before any wait for an
    engine sequence); HTTP answers report it in ``X-Slot-Id`` (:mod:`orchestrator.web.slot_header`).
    """

    def __init__(self, on_queued: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.engine: EngineClient | None = None
        self.req: int | None = None
        self.pending = False
        self.watched = False
        self.hooks = WaitHooks(on_queued)
        self.slot_id: str | None = None

    def chose(self, slot_id: str) -> None:
        """The request uses ``slot_id`` (called by :class:`GenerationService`)."""
        self.slot_id = slot_id

    async def bind(self, engine: EngineClient, req: int) -> None:
        """Called by ``run`` at the first event (the worker knows the request by then)."""
        self.engine, self.req = engine, req
        if self.pending:
            await self.cancel()

    async def cancel(self) -> None:
        """Ask the worker to stop the generation (it ends with ``finish_reason="cancelled"``)."""
        if self.engine is None or self.req is None:
            self.pending = True
            self.hooks.gone.set()
            return
        self.pending = False
        await self.engine.cancel(self.req)


class GenerationService:
    """Runs generations for the API (see module docstring)."""

    def __init__(
        self,
        engine: EngineClient,
        registry: SlotRegistry,
        anonymous: AnonymousSlots | None = None,
        watcher: TokenWatcher | None = None,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.anonymous = anonymous if anonymous is not None else AnonymousSlots(registry)
        self.watcher = watcher  # sees every generated token too (the admin page's live feed)
        self.default_seed = -1  # --seed: the seed of a request that gives none (-1: random)
        self.limits = TenantLimits()  # --tenant-generations, --tenant-stored-bytes (none by default)
        self.stall_timeout_s = 0.0  # --stall-timeout: stop and park a generation its client does not read (0: never)

    @property
    def info(self) -> proto.ModelInfo:
        """The loaded model's facts (``NO_MODEL`` while no worker is up)."""
        if self.engine.info is None:
            raise ServiceError(ErrorCode.NO_MODEL, "No model loaded")
        return self.engine.info

    async def input_ids(self, req: CanonicalRequest) -> list[int]:
        """The request's context: ``input_ids`` (validated) or its ``prompt`` tokenized."""
        info = self.info
        if req.input_ids is not None:
            ids = req.input_ids
        elif req.prompt is not None:
            ids = (await self.engine.tokenize(req.prompt, False, True)).ids
        else:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "give input_ids (token ids) or prompt (text)")
        if not ids:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "the context is empty")
        check_tokens(ids, info.vocab_size, "input_ids")
        # with --context-shift only the prompt (and one token after it) must fit: the generation shifts the window
        needed = len(ids) + (1 if info.runtime.context_shift else req.max_new_tokens)
        if needed > info.n_ctx:
            raise ServiceError(
                ErrorCode.CONTEXT_OVERFLOW,
                # llama-server's words (server-context.cpp), which its clients and tests look for
                f"request ({len(ids)} tokens + max_new_tokens {req.max_new_tokens}) exceeds the available"
                f" context size ({info.n_ctx} tokens), try increasing it",
                n_ctx=info.n_ctx,
                context_length=len(ids),
            )
        return ids

    async def resolve_bias(self, req: CanonicalRequest) -> None:
        """Replace each text key of ``req.logit_bias`` by its tokens (each gets the bias), as
        llama-server does (``common_tokenize`` without special tokens)."""
        if all(isinstance(t, int) for t, _ in req.logit_bias):
            return
        pairs: list[tuple[int | str, float]] = []
        for tok, bias in req.logit_bias:
            if isinstance(tok, int):
                pairs.append((tok, bias))
            else:
                pairs += [(t, bias) for t in (await self.engine.tokenize(tok, False, False)).ids]
        req.logit_bias = pairs

    async def checked_params(self, req: CanonicalRequest) -> SamplingParams:
        """:func:`sampling_params` of ``req`` (text ``logit_bias`` keys resolved); a grammar or JSON
        schema is built once by the worker first, so one llama.cpp cannot use is
        ``INVALID_GRAMMAR`` before any slot is touched."""
        await self.resolve_bias(req)
        if req.seed == -1:
            req.seed = self.default_seed
        params = sampling_params(req, self.info)
        if params.grammar or params.json_schema:
            await self.engine.check_sampling(params)
        return params

    async def pieces(self) -> list[bytes]:
        """Every token's raw piece, indexed by token id (sent by the worker at start-up)."""
        return self.engine.pieces

    async def run(
        self,
        req: CanonicalRequest,
        control: RunControl | None = None,
        then: Callable[[Slot], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[Started | TokenOut | ProgressOut | DoneOut, None]:
        """:meth:`_run` within the limits of the request's tenant (``req.principal``;
        :class:`orchestrator.tenants.limits.TenantLimits`: ``RATE_LIMITED`` before the first yield)."""
        tenant = req.principal.tenant
        if self.limits.stored_bytes:
            stored = sum(s.stored_bytes for s in self.registry.slots.values() if s.tenant == tenant)
            self.limits.check_stored(tenant, stored)
        with self.limits.generation(tenant):
            async with contextlib.aclosing(self._run(req, control, then)) as events:
                async for event in events:
                    yield event

    async def _run(
        self,
        req: CanonicalRequest,
        control: RunControl | None = None,
        then: Callable[[Slot], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[Started | TokenOut | ProgressOut | DoneOut, None]:
        """Validate, take the slot, generate; yields :class:`Started`, tokens, then one :class:`DoneOut`.

        With ``req.progress``, ``contract.protocol.Progress`` events come before the first
        token: one when the prefill starts, then one per at most 256 prompt tokens, the
        last with ``n_done == n_total``.

        Raises :class:`ServiceError` before the first yield for a bad request, and
        ``EngineRequestError``/``EngineDeadError`` if the worker fails mid-way.
        Closing the iterator early cancels the generation within one decode step.
        ``then(slot)`` is awaited once the engine has finished the generation, the slot still
        held (:mod:`orchestrator.generation.choices` forks the prefilled prompt there).
        """
        info = self.info
        ids = await self.input_ids(req)
        params = await self.checked_params(req)
        capture = capture_options(req, info, ids)
        hooks = control.hooks if control is not None else WaitHooks()
        on_chosen = control.chose if control is not None else None
        tenant, partition = req.principal.tenant, partition_of(req.cache_salt)  # caches never cross them
        if req.slot is None:  # docs/api.md, "Requests without a slot id"
            holding = self.anonymous.use(
                ids, tenant=tenant, partition=partition, conversation_key=req.conversation_key,
                hooks=hooks, reuse_cache=req.cache_prompt, on_chosen=on_chosen, eog=info.eog_token_ids,
            )  # fmt: skip
        else:
            if on_chosen is not None:
                on_chosen(req.slot)
            holding = self.registry.use(req.slot, tenant=tenant, partition=partition, wait=req.wait, hooks=hooks)
        async with holding as slot:
            await self.registry.enter_partition(slot, partition)
            structlog.contextvars.bind_contextvars(slot_id=slot.id)
            t0 = time.perf_counter()
            assert slot.seq is not None
            converter = TokenStream(
                set(params.stop_tokens) | (set(info.eog_token_ids) if not params.ignore_eos else set())
            )
            texts: list[str] = []
            n_out = 0
            finished = False
            events = await self.engine.generate(
                GenerationJob(
                    seq=slot.seq, input_ids=ids, params=params, capture=capture, progress=req.progress,
                    cache_reuse=req.n_cache_reuse, n_keep=req.n_keep, n_discard=req.n_discard,
                )
            )  # fmt: skip
            took = refused = False  # the worker took it (the slot's cells change) / refused it (they did not)
            stall = (slot, events.req, req.principal.tenant)
            guard = StallGuard(self.stall_timeout_s, lambda: park_stalled(self.engine, self.registry, *stall))
            try:
                if control is not None:
                    await control.bind(self.engine, events.req)
                yield Started(slot.id)
                async for event in converter.events(events):
                    if not took:
                        took = True
                        self.registry.generation_started(slot, events.req, params)
                    if isinstance(event, TokenOut):
                        out = event
                        if not out.is_stop:
                            texts.append(out.text)
                        n_out += 1
                        self.registry.generated(slot, len(ids) + n_out)  # live count; the worker's at Done
                        if self.watcher is not None:
                            self.watcher.publish(slot.id, out, capture.format, capture.dtype, capture.layers)
                        guard.offered()
                        yield out
                        await guard.taken()
                    elif isinstance(event, ProgressOut):
                        yield event
                    elif isinstance(event, proto.Done):
                        finished = True
                        log.info(
                            "generation done",
                            request_id=req.request_id,
                            finish_reason=event.finish_reason,
                            n_prompt=event.n_prompt,
                            n_cached=event.n_cached,
                            n_generated=event.n_generated,
                            t_prefill_ms=round(event.t_prefill_ms, 1),
                            t_generate_ms=round(event.t_generate_ms, 1),
                        )
                        metrics.record_generation(event, req.principal.tenant)
                        parked = guard.fired  # stored when parked, with the counts the store has
                        if not parked:
                            self.registry.generation_done(slot, event)
                        if self.registry.strict and not parked:  # stored before answered (--durability strict)
                            await events.aclose()  # the engine is done with the sequence
                            await self.registry.commit_turn(slot)
                        if then is not None:
                            if parked:
                                await self.registry.ensure_resident(slot)
                            await then(slot)
                        tail = converter.decoder.decode(b"", final=True)
                        text = "".join(texts) + tail
                        yield DoneOut.of(event, text, (time.perf_counter() - t0) * 1000, slot.id)
            except EngineRequestError as exc:
                refused = exc.refused and not took
                raise
            finally:
                await guard.close()  # a park in progress finishes under the slot's lock
                # Wait for the engine to end the generation even if this task is cancelled (a
                # client that left): the slot's lock is released only once its sequence is idle,
                # so a save or the slot's next request never finds it generating.
                await uncancellable(events.aclose())
                if refused:
                    log.info("generation refused", request_id=req.request_id)
                else:
                    if not took:  # it failed before its first event
                        self.registry.generation_started(slot, events.req, params)
                    if not finished:  # the client left or the worker failed: the engine stopped it
                        log.info("generation abandoned", request_id=req.request_id, n_generated=n_out)
                        metrics.record_abandoned(n_out)
                        self.registry.generated(slot, len(ids) + n_out)  # refreshed by the tokens action
                    self.registry.generation_ended(slot)

    async def preview(
        self,
        req: PreviewRequest,
        control: RunControl | None = None,
        principal: Principal = DEFAULT_PRINCIPAL,
        conversation_key: str | None = None,
    ) -> AsyncIterator[PreviewStarted | TokenOut | DoneOut]:
        """A preview (docs/api.md, "POST /api/v1/generate/preview"): generate on a copy-on-write
        fork of the slot's sequence (``llama_memory_seq_cp``), then discard the fork.

        Yields one :class:`PreviewStarted`, the tokens, then one :class:`DoneOut`.  The slot is
        held only while the fork is submitted (the worker applies requests in order), so its
        tokens and KV cells stay as they were and previews of one slot run concurrently.
        Raises :class:`ServiceError` before the first yield: ``INVALID_TOKEN``, ``SLOT_NOT_FOUND``
        (an explicitly named slot that does not exist, with no ``input_ids``),
        ``NO_CACHED_CONTEXT`` (no cached context and no ``input_ids``), ``INVALID_GRAMMAR``.
        Only ``principal``'s tenant's slots are seen (another tenant's is missing), and only caches
        made with the preview's own ``cache_salt`` (none: those made without one).  Naming no slot, the
        preview forks the slot ``conversation_key`` names in that partition (the request's session
        header: docs/api.md), else the slot of the tenant's latest request that named none.
        """
        tenant, partition = principal.tenant, partition_of(req.cache_salt)
        info = self.info
        append = [t.token_id if isinstance(t, AppendToken) else t for t in req.append_tokens]
        check_tokens(append, info.vocab_size, "append_tokens")
        check_tokens(req.input_ids or [], info.vocab_size, "input_ids")
        named = req.conversation_id if req.conversation_id is not None else req.id_slot
        # naming no slot: the conversation the client's key keeps (in its salt's partition), else the slot of the
        # latest request that named none (docs/api.md); a key naming nothing yet is no cache, not a 404
        keyed = keyed_id(partition, conversation_key) if conversation_key else None
        fallback = keyed or self.anonymous.last(tenant) or DEFAULT_SLOT
        slot_id = check_slot_id(str(named if named is not None else fallback))
        params = await self.checked_params(req.canonical(slot_id))
        require_attention(req.output_attentions, info.attention_layers)
        capture = CaptureOptions(
            attention=req.output_attentions, format=req.attention_format, dtype=req.attention_dtype
        )
        check_reduction(capture, info, info.n_ctx)  # a preview asks no reduction's options: topk and spans refused
        t0 = time.perf_counter()
        events: GenerationStream | None = None
        if req.use_cached_context:
            known = await self.registry.exists(slot_id, tenant)
            if not known and named is not None and req.input_ids is None:
                raise ServiceError(ErrorCode.SLOT_NOT_FOUND, f"slot {slot_id!r} does not exist")
            if known:
                hooks = control.hooks if control is not None else None  # its client leaving ends its waits
                async with self.registry.use(slot_id, tenant=tenant, wait=True, create=False, hooks=hooks) as slot:
                    if slot.n_tokens and slot.partition == partition:
                        assert slot.seq is not None
                        # the fork is taken before any later request
                        events = await self.engine.preview(slot.seq, [], append, params, capture)
        cache_hit = events is not None
        if cache_hit and control is not None:
            control.chose(slot_id)
        if events is None:
            if not req.input_ids:
                raise ServiceError(ErrorCode.NO_CACHED_CONTEXT, "No cached context available")
            events = await self.engine.preview(None, req.input_ids, append, params, capture)
        converter = TokenStream(set(params.stop_tokens) | set(info.eog_token_ids))
        texts: list[str] = []
        try:
            if control is not None:
                await control.bind(self.engine, events.req)
            yield PreviewStarted(cache_hit, slot_id)
            async for event in converter.events(events):
                if isinstance(event, TokenOut):
                    if not event.is_stop:
                        texts.append(event.text)
                    yield event
                elif isinstance(event, proto.Done):
                    log.info(
                        "preview done",
                        finish_reason=event.finish_reason,
                        n_generated=event.n_generated,
                        cache_hit=cache_hit,
                    )
                    text = "".join(texts) + converter.decoder.decode(b"", final=True)
                    yield DoneOut.of(event, text, (time.perf_counter() - t0) * 1000, slot_id)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
