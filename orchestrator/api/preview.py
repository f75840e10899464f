"""``POST /api/v1/generate/preview`` (docs/api.md): generate on a copy-on-write fork of a slot.

The slot's sequence is forked (``llama_memory_seq_cp``: cells shared) into a spare
sequence, ``append_tokens`` are prefilled on the fork only, up to ``max_tokens`` are
generated, and the fork is discarded: the slot's tokens and KV cells are untouched.
The slot is held only while the fork is submitted (the worker applies requests in
order), so previews of one slot run concurrently with each other and with later
generations, in the same decode batches.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from litestar import Controller, Request, post

from engine import protocol as proto
from orchestrator import wire
from orchestrator.api.body import json_route
from orchestrator.api.generate import cancelled_on_disconnect
from orchestrator.engine_api import TokenOutput
from orchestrator.errors import ApiError
from orchestrator.generation import RunControl, TokenStream, check_tokens
from orchestrator.schemas import AppendToken, PreviewRequest
from orchestrator.services import Services
from orchestrator.slots import check_slot_id

log = structlog.get_logger("slotserve.preview")
STOPPED = {"length": "max_tokens", "stop_token": "stop_token", "stop_string": "stop_string", "cancelled": "cancelled"}


def _params(data: PreviewRequest, vocab: int) -> proto.SamplingParams:
    """Sampler settings (value ranges are checked when the body is decoded: ``schemas.py``)."""
    check_tokens(data.stop_tokens, vocab, "stop_tokens")
    return proto.SamplingParams(
        max_new_tokens=data.max_tokens,
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=max(0, data.top_k),
        min_p=0.0,
        seed=data.seed,
        stop_tokens=data.stop_tokens,
    )


class PreviewController(Controller):
    """Seed 003's preview endpoint."""

    @post(
        "/api/v1/generate/preview",
        status_code=200,
        summary="Preview continuation on a forked KV cache",
        **json_route(PreviewRequest),
    )
    async def preview(
        self, request: Request[Any, Any, Any], services: Services, data: PreviewRequest
    ) -> dict[str, Any]:
        async with cancelled_on_disconnect(request) as control:
            return await self._preview(services, data, control)

    async def _preview(self, services: Services, data: PreviewRequest, control: RunControl) -> dict[str, Any]:
        info = services.generation.info
        engine = services.engine
        append = [t.token_id if isinstance(t, AppendToken) else t for t in data.append_tokens]
        check_tokens(append, info.vocab_size, "append_tokens")
        if data.input_ids is not None:
            check_tokens(data.input_ids, info.vocab_size, "input_ids")
        params = _params(data, info.vocab_size)
        capture = proto.CaptureOptions(
            attention=data.output_attentions, format=data.attention_format, dtype=data.attention_dtype
        )
        slot_id = check_slot_id(
            str(
                data.conversation_id
                if data.conversation_id is not None
                else data.id_slot
                if data.id_slot is not None
                else "0"
            )
        )
        explicit = data.conversation_id is not None or data.id_slot is not None
        t0 = time.perf_counter()
        cache_hit = False
        events = None
        if data.use_cached_context:
            known = services.registry.find(slot_id) is not None or (
                services.persistence is not None and await services.persistence.lookup(slot_id) is not None
            )
            if not known and explicit and data.input_ids is None:
                raise ApiError("SLOT_NOT_FOUND", f"slot {slot_id!r} does not exist")
            if known:
                async with services.registry.use(slot_id, wait=True, create=False) as slot:
                    if slot.n_tokens:
                        # the fork is taken before any later request
                        events = await engine.preview(slot.seq, [], append, params, capture)
                        cache_hit = True
        if events is None:
            if not data.input_ids:
                raise ApiError("NO_CACHED_CONTEXT", "No cached context available")
            events = await engine.preview(None, data.input_ids, append, params, capture)
        await control.bind(engine, events.req)
        stream = TokenStream(set(params.stop_tokens) | set(info.eog_token_ids))
        tokens: list[dict[str, Any]] = []
        attention: list[dict[str, Any]] = []
        texts: list[str] = []
        done: proto.Done | None = None
        try:
            async for event in events:
                if isinstance(event, TokenOutput):
                    out = stream.convert(event)
                    tokens.append(wire.token_text_fields(out))
                    if not out.is_stop:
                        texts.append(out.text)
                    if out.attention is not None:
                        attention.append(
                            wire.token_text_fields(out)
                            | {"attention": wire.attention_json(out, data.attention_format, data.attention_dtype)}
                        )
                elif isinstance(event, proto.Done):
                    done = event
        finally:
            await events.aclose()
        assert done is not None
        log.info("preview done", stopped_reason=done.finish_reason, n_generated=done.n_generated, cache_hit=cache_hit)
        texts.append(stream.decoder.decode(b"", final=True))
        body: dict[str, Any] = {
            "text": "".join(texts),
            "tokens": tokens,
            "token_count": len(tokens),
            "stopped_reason": STOPPED.get(done.finish_reason, done.finish_reason),
            "cache_hit": cache_hit,
            "generation_time_ms": round((time.perf_counter() - t0) * 1000, 3),
            "n_prefilled": done.n_prefilled,
            "n_cached": done.n_cached,
            "slot_id": wire.slot_id_out(slot_id) if cache_hit else None,
        }
        if data.output_attentions:
            body["attention_data"] = attention
        return body
