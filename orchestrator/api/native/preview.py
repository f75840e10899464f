"""``POST /api/v1/generate/preview`` (docs/api.md): generate on a copy-on-write fork of a slot.

The handler parses the body, runs :meth:`GenerationService.preview` (which forks the slot's
sequence, generates and discards the fork, leaving the slot untouched) and answers its
events as one :class:`orchestrator.responses.PreviewResponse`.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post

from orchestrator.api.common.run import cancelled_on_disconnect
from orchestrator.api.common.wire import TokenText, token_text
from orchestrator.api.native.protocol import PreviewResponse, TokenAttention, token_attention
from orchestrator.generation.events import DoneOut, PreviewStarted, TokenOut
from orchestrator.generation.request import PreviewRequest
from orchestrator.services import Services
from orchestrator.slots.model import slot_id_out
from orchestrator.tenants.conversation import conversation_key
from orchestrator.tenants.principal import principal_of
from orchestrator.web.body import json_route

STOPPED = {"length": "max_tokens", "stop_token": "stop_token", "stop_string": "stop_string", "cancelled": "cancelled"}
"""The engine's ``finish_reason`` as the preview's ``stopped_reason``."""


class PreviewController(Controller):
    """The preview endpoint (docs/api.md, "POST /api/v1/generate/preview")."""

    @post(
        "/api/v1/generate/preview",
        status_code=200,
        summary="Preview continuation on a forked KV cache",
        **json_route(PreviewRequest),
    )
    async def preview(
        self, request: Request[Any, Any, Any], services: Services, data: PreviewRequest
    ) -> PreviewResponse:
        tokens: list[TokenText] = []
        attention: list[TokenAttention] = []
        started: PreviewStarted | None = None
        end: DoneOut | None = None
        async with cancelled_on_disconnect(request) as control:
            key = conversation_key(request.headers)  # a session header: the conversation it keeps
            async for ev in services.generation.preview(data, control, principal_of(request), key):
                if isinstance(ev, TokenOut):
                    tokens.append(token_text(ev))
                    if ev.attention is not None:
                        attention.append(token_attention(ev, data.attention_format, data.attention_dtype))
                elif isinstance(ev, PreviewStarted):
                    started = ev
                else:
                    end = ev
        assert started is not None and end is not None
        return PreviewResponse(
            text=end.text,
            tokens=tokens,
            token_count=len(tokens),
            stopped_reason=STOPPED.get(end.finish_reason, end.finish_reason),
            cache_hit=started.cache_hit,
            generation_time_ms=round(end.generation_time_ms, 3),
            n_prefilled=end.n_prefilled,
            n_cached=end.n_cached,
            slot_id=slot_id_out(started.slot_id) if started.cache_hit else None,
            **({"attention_data": attention} if data.output_attentions else {}),
        )
