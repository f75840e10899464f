"""llama-server's native API: ``POST /completion`` (and ``/completions``), ``GET /props``.

Field names and shapes are llama-server's (llama.cpp ``tools/server/README.md``;
``tools/server/server-task.cpp``: ``to_json_non_oaicompat``, ``task_params::to_json``;
``server-common.cpp``: ``server_slot_stats::to_json`` for ``timings``), so its clients and
its own test suite (``tools/server/tests/unit``) work unchanged.  Errors have its shape,
``{"error": {"code", "message", "type"}}`` (:mod:`orchestrator.api.compat`).

Slots: ``id_slot`` names the slot (an integer as llama-server's, or any slotserve slot id), and a
busy slot is waited for (bounded) where llama-server would pick another idle slot; ``-1`` or
none lets the server choose by prompt similarity as llama-server does
(:mod:`orchestrator.slots.anonymous`), and ``id_slot`` in the answer says which.  ``cache_prompt:
false`` empties a named slot first, and gives a request naming none a new, empty slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from msgspec import UNSET, UnsetType

from contract import protocol as proto
from contract.errors import ErrorCode
from orchestrator.api.compat import COMPAT_ERRORS, collect, piece_text, remaining, started_run
from orchestrator.api.llama_server.prompts import split_prompts, subprompt_ids
from orchestrator.api.llama_server.protocol import (
    CompletionBody,
    CompletionProb,
    DefaultSettings,
    LlamaCompletion,
    LlamaCompletionChunk,
    Modalities,
    Props,
    SamplerSettings,
    SubPrompt,
    TokenProb,
)
from orchestrator.api.llama_server.reasoning import completion_reasoning, split_text
from orchestrator.api.llama_server.timings import TimingsClock, timings_of
from orchestrator.api.native.generate import cancelled_on_disconnect
from orchestrator.api.native.protocol import GenerateRequest, PromptProgress
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.interleave import interleaved
from orchestrator.generation.parsers.reasoning import ReasoningPlan
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.service import RunControl, sampling_params
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.services import Services
from orchestrator.slots.admission import WaitHooks
from orchestrator.slots.model import Slot, slot_id_out
from orchestrator.slots.operations import SlotOps
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError, compat_error_body, report, route_of
from orchestrator.web.sse import EventStream, sse_data, streamable

STOP_TYPE = {"length": "limit", "stop_token": "eos", "stop_string": "word", "cancelled": "none"}
DEFAULT_PARAMS = proto.SamplingParams(max_new_tokens=-1)
# llama-server's default sampler order, its ``samplers`` names (engine/sampling.py builds the chain so)
SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


def params_json(p: proto.SamplingParams | None, n_ctx: int | None = None) -> dict[str, Any]:
    """llama-server's ``params`` / ``generation_settings`` object for sampler settings ``p``."""
    p = p or DEFAULT_PARAMS
    out: dict[str, Any] = {
        "seed": p.seed,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "max_tokens": p.max_new_tokens,
        "n_predict": p.max_new_tokens,
        "ignore_eos": p.ignore_eos,
        "n_probs": p.n_probs,
        "post_sampling_probs": p.post_sampling_probs,
        "stop": list(p.stop_strings),
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "typical_p": p.typical_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers),
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "grammar": p.grammar,
        # a banned token is llama-server's -inf bias, which its JSON writes as null
        "logit_bias": [{"bias": b, "token": t} for t, b in p.logit_bias]
        + [{"bias": None, "token": t} for t in p.banned_tokens],
        "samplers": SAMPLERS,
    }
    if n_ctx is not None:
        out["n_ctx"] = n_ctx
    return out


def slot_task_fields(slot: Slot) -> dict[str, Any]:
    """The fields llama-server's ``GET /slots`` adds once a slot has served a task."""
    if slot.id_task < 0:
        return {"speculative": False}
    n_remain = (slot.params.max_new_tokens - slot.n_decoded) if slot.params else 0
    return {
        "speculative": False,
        "id_task": slot.id_task,
        "n_prompt_tokens": slot.n_tokens,
        "n_prompt_tokens_processed": slot.n_prompt_tokens_processed,
        "n_prompt_tokens_cache": slot.n_prompt_tokens_cache,
        "params": params_json(slot.params),
        "next_token": [
            {
                "has_next_token": slot.busy,
                "has_new_line": False,
                "n_remain": max(0, n_remain) if slot.busy else -1,
                "n_decoded": slot.n_decoded if slot.busy else 0,  # an idle slot: 0, as llama-server (its stats reset)
            }
        ],
    }


def check_slot_number(slot_id: str) -> None:
    """llama-server answers a negative slot number with 400 ``Invalid slot ID``."""
    if slot_id.startswith("-") and slot_id[1:].isdigit():
        raise ApiError(ErrorCode.INVALID_REQUEST, "Invalid slot ID")


def _alternative(tok: int, pieces: list[bytes], **value: float) -> TokenProb:
    """One of a token's alternatives: ``logprob=`` or ``prob=``."""
    return TokenProb(id=tok, token=piece_text(pieces[tok]), bytes_=list(pieces[tok]), **value)


def _probs(t: TokenOut, pieces: list[bytes], post_sampling: bool) -> CompletionProb:
    """``t``'s ``completion_probabilities`` entry: its logprobs, or with ``post_sampling`` (llama-server's
    ``post_sampling_probs``) its probabilities after the sampler chain (``prob``, ``top_probs``)."""
    out = CompletionProb(id=t.token_id, token=piece_text(t.piece), bytes_=list(t.piece))
    if post_sampling:
        out.prob = t.prob if t.prob is not None else 1.0  # llama-server's value when it has none
        out.top_probs = [_alternative(k, pieces, prob=p) for k, p in t.top_probs]
    else:
        out.logprob = t.logprob
        out.top_logprobs = [_alternative(k, pieces, logprob=lp) for k, lp in t.top]
    return out


class Completion:
    """One ``/completion`` request: its canonical form and the response shapes."""

    def __init__(
        self,
        body: CompletionBody,
        req: CanonicalRequest,
        info: proto.ModelInfo,
        pieces: list[bytes],
        model: str,
        index: int = 0,
        reasoning: ReasoningPlan | None = None,
    ):
        self.body, self.req, self.info, self.pieces, self.index = body, req, info, pieces, index
        self.reasoning = reasoning  # thoughts split out when reasoning.split
        self.model, self.n_ctx = model, info.n_ctx
        self.slot_out: int | str = -1 if req.slot is None else slot_id_out(req.slot)  # set once a slot is chosen

    def probs(self, tokens: list[TokenOut]) -> list[CompletionProb]:
        """``tokens``' ``completion_probabilities`` entries (``post_sampling_probs``: ``prob``, ``top_probs``)."""
        return [_probs(t, self.pieces, self.body.post_sampling_probs) for t in tokens]

    def partial(self, text: str, tokens: list[TokenOut], n_done: int) -> LlamaCompletionChunk:
        """A streamed chunk (``stop: false``)."""
        return LlamaCompletionChunk(
            index=self.index,
            content=text,
            tokens=[t.token_id for t in tokens] if self.body.return_tokens else [],
            id_slot=self.slot_out,
            tokens_predicted=n_done,
            tokens_evaluated=len(self.req.input_ids or ()),
            completion_probabilities=self.probs(tokens) if self.body.n_probs else UNSET,
        )

    def final(self, text: str, tokens: list[TokenOut], done: DoneOut, prompt: str) -> LlamaCompletion:
        """The last (or only) response (``stop: true``, ``timings``)."""
        d = done
        probs = self.body.n_probs and not self.body.stream
        thoughts = self.reasoning.parser() if self.reasoning else None
        thought: str | UnsetType = UNSET
        if thoughts is not None and not self.body.stream:
            text, thought = split_text(thoughts.whole(text))
        return LlamaCompletion(
            index=self.index,
            content=text,
            reasoning_content=thought,
            tokens=[t.token_id for t in tokens] if self.body.return_tokens else [],
            id_slot=slot_id_out(done.slot_id),
            stop=True,
            model=self.model,
            tokens_predicted=d.n_generated,
            tokens_evaluated=d.n_prompt,
            generation_settings=msgspec.convert(
                params_json(sampling_params(self.req, self.info), self.n_ctx), SamplerSettings
            ),
            prompt=prompt,
            has_new_line="\n" in text,
            truncated=d.truncated,
            stop_type=STOP_TYPE.get(d.finish_reason, "none"),
            stopping_word=d.stop_string,
            tokens_cached=d.seq_tokens,
            timings=timings_of(d),
            completion_probabilities=self.probs(tokens) if probs else UNSET,
        )


def nested_values(paths: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """``response_fields``: the values at ``paths`` (``"a/b"`` reads ``result["a"]["b"]``), keyed by
    the path; paths that lead nowhere are left out (llama-server ``json_get_nested_values``)."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = result
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out


async def _complete(
    request: Request[Any, Any, Any],
    services: Services,
    ops: SlotOps,
    data: CompletionBody,
    prompt: SubPrompt,
    index: int,
) -> LlamaCompletion:
    """One prompt of a non-streamed ``/completion``, run to its end: llama-server's final result."""
    async with cancelled_on_disconnect(request) as control:  # from the erase (cache_prompt false) on
        c = await _prepare(services, ops, data, control.hooks, prompt, index)
        got = await collect(services, c.req, request, control)
    kept = [t for t in got.tokens if not t.is_stop]
    text = StopTextFilter.whole(c.req.stop_strings, (t.text for t in kept), got.end.stop_string)
    return c.final(text, got.tokens, got.end, await services.engine.detokenize(c.req.input_ids or []))


async def _prepare(
    services: Services, ops: SlotOps, body: CompletionBody, hooks: WaitHooks, prompt: SubPrompt, index: int = 0
) -> Completion:
    ids = await subprompt_ids(services, prompt)
    if not 0 <= body.n_probs <= 100:
        raise ApiError(ErrorCode.INVALID_REQUEST, "n_probs must be in 0..100")
    slot = None if str(body.id_slot) == "-1" else body.id_slot
    n_predict = body.n_predict if body.n_predict is not None else services.settings.n_predict
    if n_predict < 0:
        n_predict = remaining(services, len(ids))
    req = GenerateRequest(
        input_ids=ids,
        n_predict=n_predict,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        repeat_last_n=body.repeat_last_n,
        seed=body.seed,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
        n_probs=body.n_probs,
        id_slot=slot,
        **body.sampler_fields(),
    ).canonical()
    req.wait = True
    req.post_sampling_probs = body.post_sampling_probs
    if body.ignore_eos:  # llama-server bans the end-of-generation tokens (-inf logit bias), not just goes on
        req.banned_tokens = sorted(set(req.banned_tokens) | set(services.generation.info.eog_token_ids))
    if not body.cache_prompt and req.slot is None:
        req.cache_prompt = False  # a new, empty slot
    elif not body.cache_prompt and req.slot is not None:
        async with services.registry.use(req.slot, wait=True, create=True, resident=False, hooks=hooks) as s:
            await ops.erase(s)
    thinking = await completion_reasoning(services, body, ids)
    if thinking is not None:
        thinking.constrain(req)
    info = services.generation.info
    return Completion(body, req, info, await services.generation.pieces(), services.model_id, index, thinking)


class LlamaServerController(Controller):
    """llama-server's native completion and props (errors in its ``{"error": {...}}`` shape)."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @get(
        "/props",
        summary="llama-server: server properties and default generation settings",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def props(self, services: Services) -> Props:
        info = services.generation.info
        special = info.special_tokens
        return Props(
            default_generation_settings=msgspec.convert(
                {
                    "params": params_json(msgspec.structs.replace(DEFAULT_PARAMS, seed=services.settings.seed)),
                    "n_ctx": info.n_ctx,
                },
                DefaultSettings,
            ),
            total_slots=services.settings.worker.engine.n_slots,
            model_alias=services.model_id,
            model_path=info.model_path,
            modalities=Modalities(vision=False, video=False, audio=False),
            endpoint_slots=True,
            endpoint_props=False,
            endpoint_metrics=True,
            chat_template=info.chat_template,
            bos_token=special.get("bos_token", ""),
            eos_token=special.get("eos_token", ""),
            build_info=f"llama-cpp-python {info.llama_cpp_version} (slotserve)",
            is_sleeping=False,
        )

    @post(
        ["/completion", "/completions"],
        status_code=200,
        summary="llama-server: native completion",
        responses=streamable(LlamaCompletion | list[LlamaCompletion]),  # several prompts: a list
    )
    async def completion(
        self, request: Request[Any, Any, Any], services: Services, ops: SlotOps, data: CompletionBody
    ) -> EventStream | LlamaCompletion | list[LlamaCompletion] | dict[str, Any]:
        prompts = split_prompts(data.prompt)
        if not data.stream:
            results = [await _complete(request, services, ops, data, p, i) for i, p in enumerate(prompts)]
            if data.response_fields:  # llama-server's json_get_nested_values, per result
                picked = [nested_values(data.response_fields, msgspec.to_builtins(r)) for r in results]
                return picked[0] if len(picked) == 1 else picked  # type: ignore[return-value]
            return results[0] if len(results) == 1 else results
        async with cancelled_on_disconnect(request) as control:  # from the erase (cache_prompt false) on
            c = await _prepare(services, ops, data, control.hooks, prompts[0])
            c.req.progress = data.return_progress or data.timings_per_token  # prefill figures
            run = await started_run(services, c.req, request, control)  # a bad first prompt: a plain 4xx
            if control.slot_id is not None:
                c.slot_out = slot_id_out(control.slot_id)

        async def first() -> AsyncIterator[tuple[Completion, Any]]:
            try:
                async for ev in run:
                    yield c, ev
            finally:
                await run.aclose()

        async def later(index: int, prompt: SubPrompt) -> AsyncIterator[tuple[Completion, Any]]:
            """Prompt ``index``, started once the stream runs (it may wait for a slot the others hold)."""
            control = RunControl()
            control.watched = True  # the stream's end (a client leaving) cancels it
            one = await _prepare(services, ops, data, control.hooks, prompt, index)
            one.req.progress = c.req.progress
            started = await started_run(services, one.req, request, control)
            if control.slot_id is not None:
                one.slot_out = slot_id_out(control.slot_id)
            try:
                async for ev in started:
                    yield one, ev
            finally:
                await started.aclose()

        sources = [first(), *(later(i, p) for i, p in enumerate(prompts) if i > 0)]

        async def events() -> AsyncIterator[bytes]:
            streams: dict[int, PromptStream] = {}
            try:
                async with contextlib.aclosing(interleaved(sources)) as merged:
                    async for _, (one, ev) in merged:
                        out = streams.setdefault(one.index, PromptStream(one, data))
                        for chunk in out.event(ev):
                            yield sse_data(chunk)
            except Exception as exc:
                yield sse_data(compat_error_body(report(exc, route_of(request))))

        return EventStream(events())


class PromptStream:
    """One prompt's streamed ``/completion`` chunks (llama-server's ``server_task_result_cmpl_partial``,
    then its final result; ``tools/server/server-task.cpp``), each with the prompt's ``index``:
    text as stop strings allow (:class:`StopTextFilter`), prefill progress (``return_progress``),
    timings per chunk (``timings_per_token``)."""

    def __init__(self, c: Completion, data: CompletionBody) -> None:
        self.c, self.data = c, data
        self.filt = StopTextFilter(c.req.stop_strings)
        self.thoughts = c.reasoning.parser() if c.reasoning else None
        self.pending: list[TokenOut] = []
        self.n = 0
        self.clock = TimingsClock(data.timings_per_token)

    def _split(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(content, reasoning)`` of released ``text`` (all content without ``reasoning_format``)."""
        if self.thoughts is None:
            return text, ""
        return split_text(self.thoughts.feed(text) + (self.thoughts.finish() if final else []))

    def _chunk(self, text: str, thought: str) -> LlamaCompletionChunk:
        chunk = self._timed(self.c.partial(text, self.pending, self.n))
        if thought:
            chunk.reasoning_content = thought
        self.pending = []
        return chunk

    def _timed(self, chunk: LlamaCompletionChunk) -> LlamaCompletionChunk:
        chunk.timings = self.clock.now()
        return chunk

    def event(self, ev: Any) -> list[LlamaCompletionChunk | LlamaCompletion]:
        """The chunks of one generation event (:class:`ProgressOut`, :class:`TokenOut`, :class:`DoneOut`)."""
        c = self.c
        if isinstance(ev, ProgressOut):
            self.clock.progress(ev)
            if not self.data.return_progress:
                return []
            chunk = self._timed(c.partial("", [], self.n))
            chunk.prompt_progress = PromptProgress(
                total=ev.total, cache=ev.cache, processed=ev.processed, time_ms=ev.time_ms
            )
            return [chunk]
        if isinstance(ev, TokenOut):
            self.n += 1
            self.clock.token()
            self.pending.append(ev)
            text, thought = self._split(self.filt.feed("" if ev.is_stop else ev.text))
            if not (text or thought or ev.is_stop):
                return []
            return [self._chunk(text, thought)]
        if isinstance(ev, DoneOut):
            rest, thought = self._split(self.filt.finish(ev.stop_string), final=True)
            chunks: list[LlamaCompletionChunk | LlamaCompletion] = []
            if rest or thought or self.pending:
                chunks.append(self._chunk(rest, thought))
            return [*chunks, c.final("", [], ev, "")]
        return []
