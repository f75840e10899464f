"""llama-server's native API: ``POST /completion`` (and ``/completions``), ``GET /props``.

Field names and shapes are llama-server's (llama.cpp ``tools/server/README.md``;
``tools/server/server-task.cpp``: ``to_json_non_oaicompat``, ``task_params::to_json``;
``server-common.cpp``: ``server_slot_stats::to_json`` for ``timings``), so its clients and
its own test suite (``tools/server/tests/unit``) work unchanged.  Errors have its shape,
``{"error": {"code", "message", "type"}}`` (:mod:`orchestrator.api.common.run`).

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

from contract.errors import ErrorCode
from orchestrator.api.common.completion import (
    DEFAULT_PARAMS,
    Completion,
    CompletionBody,
    LlamaCompletion,
    LlamaCompletionChunk,
    SubPrompt,
    nested_values,
    params_json,
    split_text,
)
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.common.prompts import split_prompts, subprompt_ids
from orchestrator.api.common.run import (
    COMPAT_ERRORS,
    cancelled_on_disconnect,
    collect,
    remaining,
    started_run,
)
from orchestrator.api.common.timings import TimingsClock
from orchestrator.api.common.wire import PromptProgress
from orchestrator.api.llama_server.protocol import DefaultSettings, Modalities, Props
from orchestrator.api.llama_server.reasoning import completion_reasoning
from orchestrator.generation.events import DoneOut, ProgressOut, TokenOut
from orchestrator.generation.interleave import interleaved
from orchestrator.generation.service import RunControl
from orchestrator.generation.stop_text import StopTextFilter
from orchestrator.services import Services
from orchestrator.slots.admission import WaitHooks
from orchestrator.slots.model import Slot, slot_id_out
from orchestrator.slots.operations import SlotOps
from orchestrator.tenants.conversation import identify
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError, compat_error_body, report, route_of
from orchestrator.web.sse import EventStream, sse_data, streamable


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
        c = await _prepare(request, services, ops, data, control.hooks, prompt, index)
        got = await collect(services, c.req, request, control)
    kept = [t for t in got.tokens if not t.is_stop]
    text = StopTextFilter.whole(c.req.stop_strings, (t.text for t in kept), got.end.stop_string)
    return c.final(text, got.tokens, got.end, await services.engine.detokenize(c.req.input_ids or []))


async def _prepare(
    request: Request[Any, Any, Any],
    services: Services,
    ops: SlotOps,
    body: CompletionBody,
    hooks: WaitHooks,
    prompt: SubPrompt,
    index: int = 0,
) -> Completion:
    ids = await subprompt_ids(services, prompt)
    if not 0 <= body.n_probs <= 100:
        raise ApiError(ErrorCode.INVALID_REQUEST, "n_probs must be in 0..100")
    thinking = await completion_reasoning(services, body, ids)  # a bad reasoning_format: 400 before the erase
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
    identify(req, request)
    req.wait = True
    req.post_sampling_probs = body.post_sampling_probs
    req.token_logprobs = body.n_probs > 0  # llama-server's completion_probabilities: only with n_probs
    if thinking is not None:
        thinking.constrain(req)
    if body.ignore_eos:  # llama-server bans the end-of-generation tokens (-inf logit bias), not just goes on
        req.banned_tokens = sorted(set(req.banned_tokens) | set(services.generation.info.eog_token_ids))
    if not body.cache_prompt and req.slot is None:
        req.cache_prompt = False  # a new, empty slot
    elif not body.cache_prompt and req.slot is not None:
        tenant = req.principal.tenant  # the caller's (filled by the surface): its own slot only
        held = services.registry.use(req.slot, tenant=tenant, wait=True, create=True, resident=False, hooks=hooks)
        async with held as s:
            await ops.erase(s)
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
            c = await _prepare(request, services, ops, data, control.hooks, prompts[0])
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
            one = await _prepare(request, services, ops, data, control.hooks, prompt, index)
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
