"""An OpenAI body's generation request (:class:`orchestrator.generation.request.CanonicalRequest`): its sampler
fields, the slot it names (``slot_id``, ``X-Slot-Id``, ``user``), ``n`` and the logprobs it asks for."""

from __future__ import annotations

from typing import Any, TypeVar

from litestar import Request

from contract.errors import ErrorCode
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.common.run import (
    remaining,
)
from orchestrator.api.openai.protocol import (
    MAX_TOP_LOGPROBS,
    OpenAIRequest,
)
from orchestrator.generation.request import (
    CanonicalRequest,
)
from orchestrator.services import Services
from orchestrator.tenants.conversation import identify
from orchestrator.web.errors import ApiError

T = TypeVar("T")


LLAMA_SERVER_TOP_LOGPROBS = 20  # chat logprobs: true without top_logprobs (llama-server's n_probs default there)


def _slot(data: OpenAIRequest, request: Request[Any, Any, Any]) -> str | None:
    for v in (data.slot_id, request.headers.get("x-slot-id"), data.user):
        if v is not None and str(v) != "":
            return str(v)
    return None


def canonical(
    data: OpenAIRequest, request: Request[Any, Any, Any], ids: list[int], services: Services, n_probs: int
) -> CanonicalRequest:
    """The generation request for an OpenAI body whose prompt is ``ids`` (bad values: ``INVALID_REQUEST``)."""
    if data.n is not None and data.n < 1:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"n={data.n}: n must be at least 1")
    max_tokens = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
    att = data.attention
    fields = data.sampler_fields()
    if data.response_format is not None and data.json_schema is None:
        fields["json_schema"] = data.response_format.schema_json()
    req = GenerateRequest(
        **fields,
        input_ids=ids,
        max_new_tokens=max_tokens if max_tokens is not None else remaining(services, len(ids)),
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=data.top_k,
        min_p=data.min_p,
        repeat_penalty=data.repeat_penalty,
        seed=data.seed,
        stop=data.stop,
        ignore_eos=data.ignore_eos,
        return_attention=att is not None,
        attention_format=att.format if att else "per_layer",
        attention_dtype=att.dtype if att else "float32",
        attention_layers=att.layers if att else None,
        n_probs=n_probs,
        id_slot=_slot(data, request),
        return_progress=data.stream and (data.n or 1) == 1 and (data.return_progress or data.timings_per_token),
    ).canonical()
    identify(req, request, data.prompt_cache_key)
    req.wait = True
    return req


def _top_n(logprobs: bool | None, top: int | None) -> int:
    """The alternatives per token of a chat body: ``top_logprobs``, or with ``logprobs: true`` and no
    ``top_logprobs`` 20, llama-server's default (``oaicompat_chat_params_parse``: ``n_probs`` =
    ``json_value(body, "top_logprobs", 20)``); ``INVALID_REQUEST`` outside 0..20 or without ``logprobs``."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
    if top and not logprobs:
        raise ApiError(ErrorCode.INVALID_REQUEST, "top_logprobs needs logprobs: true")
    if logprobs and top is None:
        return LLAMA_SERVER_TOP_LOGPROBS
    return top or 0
