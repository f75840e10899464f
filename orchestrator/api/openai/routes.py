"""OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Shapes follow OpenAI's API reference (Chat Completions, Completions, Models) as
llama-server serves them (``tools/server/server-task.cpp``: ``to_json_oaicompat*``): SSE
chunks ``data: {json}`` ending ``data: [DONE]``, ``stream_options.include_usage`` (a last
chunk with empty ``choices`` and ``usage``), ``logprobs``/``top_logprobs``,
``usage.prompt_tokens_details.cached_tokens``.  Like llama-server, ``/models`` and
``/chat/completions`` also answer without the ``/v1`` prefix (``/completions`` without it
is llama-server's native completion, see :mod:`orchestrator.api.llama_server.routes`).

slotserve extensions (docs/api.md "OpenAI-compatible API"):

* the slot (KV cache) a request uses: ``slot_id`` in the body, else the ``X-Slot-Id``
  header, else ``user``; a busy slot is waited for (bounded).  Naming none, the server chooses
  by prompt similarity (:mod:`orchestrator.slots.anonymous`); the ``X-Slot-Id`` response header (and
  ``slot_id`` in a non-streamed answer) says which.
* ``"attention": {"format": "aggregated"|"per_layer", "dtype", "layers"}`` adds each
  generated token's attention (base64, as on the other JSON paths) to the choice, per chunk.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from litestar import Controller, Request, get, post

from contract.errors import ErrorCode
from orchestrator.api.common.run import (
    COMPAT_ERRORS,
)
from orchestrator.api.openai.choices import respond_choices
from orchestrator.api.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    ModelCard,
    ModelList,
    ModelMeta,
)
from orchestrator.api.openai.serving import chat_shape, respond
from orchestrator.services import Services
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError
from orchestrator.web.sse import EventStream, streamable

log = structlog.get_logger("slotserve.openai")


class OpenAIController(Controller):
    """The OpenAI-compatible paths (errors in OpenAI's ``{"error": {...}}`` shape)."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @get(["/v1/models", "/models"], summary="OpenAI: the loaded model", responses=COMPAT_ERROR_RESPONSES)
    async def models(self, services: Services) -> ModelList:
        info = services.generation.info
        meta = ModelMeta(
            n_ctx_train=info.n_ctx_train,
            n_ctx=info.n_ctx,
            n_vocab=info.vocab_size,
            n_params=info.n_params,
            size=info.size_bytes,
        )
        card = ModelCard(
            id=services.model_id,
            aliases=sorted(services.settings.alias),
            tags=sorted(services.settings.tags),
            object="model",
            created=int(time.time()),
            owned_by="slotserve",
            meta=meta,
        )
        return ModelList(object="list", data=[card])

    @post(
        ["/v1/chat/completions", "/chat/completions"],
        status_code=200,
        summary="OpenAI chat completion",
        responses=streamable(ChatCompletion),
    )
    async def chat(
        self, request: Request[Any, Any, Any], services: Services, data: ChatCompletionRequest
    ) -> EventStream | ChatCompletion:
        if not data.messages:
            raise ApiError(ErrorCode.INVALID_REQUEST, "messages must not be empty")
        shape = await chat_shape(services, request, data)
        if (data.n or 1) > 1:
            return await respond_choices(services, request, data, shape, ChatCompletion)
        return await respond(services, request, data, shape, ChatCompletion)
