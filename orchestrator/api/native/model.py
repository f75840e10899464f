"""Model facts and tokenization: ``/api/v1/...`` (docs/api.md, "Model") and llama-server's names."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, get, post

from contract.errors import ErrorCode
from orchestrator.api.common.run import COMPAT_ERRORS
from orchestrator.api.common.wire import TokenText
from orchestrator.api.native.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LlamaDetokenizeResponse,
    LlamaTokenizeResponse,
    ModelResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
)
from orchestrator.services import Services
from orchestrator.tokens import check_tokens
from orchestrator.web.body import json_route
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ERROR_RESPONSES, ApiError


def model_payload(s: Services) -> ModelResponse:
    """The fields of ``GET /api/v1/model`` and ``/api/v1/model/info`` (docs/api.md, "Model")."""
    i = s.generation.info
    name = i.model_name
    return ModelResponse(
        result=name,
        model_name=name,
        model_path=i.model_path,
        architecture=i.architecture,
        description=i.description,
        fingerprint=i.fingerprint,
        vocab_size=i.vocab_size,
        num_layers=i.num_layers,
        num_attention_heads=i.num_attention_heads,
        num_key_value_heads=i.num_key_value_heads,
        hidden_size=i.hidden_size,
        embedding_size=i.hidden_size,
        max_position_embeddings=i.n_ctx_train,
        max_trained_context=i.n_ctx_train,
        max_context_length=i.n_ctx,
        context_length=i.n_ctx,
        rope_theta=i.rope_freq_base,
        rope_freq_base=i.rope_freq_base,
        rope_freq_scale=i.rope_freq_scale,
        bos_token_id=i.bos_token_id,
        eos_token_id=i.eos_token_id,
        eot_token_id=i.eot_token_id,
        eog_token_ids=i.eog_token_ids,
        special_tokens=i.special_tokens,
        chat_template=i.chat_template,
        torch_dtype="gguf",
        n_params=i.n_params,
        size_bytes=i.size_bytes,
        n_slots=i.n_slots,
        n_kv_cells=i.n_kv_cells,
        attention_layers=i.attention_layers,
        attention_windows=i.attention_windows,
        memory=msgspec.to_builtins(i.memory),
        llama_cpp_python=i.llama_cpp_version,
        engine=msgspec.to_builtins(i.runtime),
    )


def _piece_fields(piece: bytes) -> dict[str, Any]:
    try:
        return {"text": piece.decode("utf-8")}
    except UnicodeDecodeError:
        return {"text": piece.decode("utf-8", "replace"), "bytes": list(piece)}


class ModelController(Controller):
    """``/api/v1/model``, tokenize and detokenize (docs/api.md; llama-server's ``/tokenize``)."""

    @get(
        ["/api/v1/model", "/api/v1/model/info"],
        summary="Model architecture and special tokens",
        responses=ERROR_RESPONSES,
    )
    async def model(self, services: Services) -> ModelResponse:
        return model_payload(services)

    @post(
        "/api/v1/tokenize",
        status_code=200,
        summary="Text to tokens with their text",
        **json_route(TokenizeRequest),
    )
    async def tokenize(self, services: Services, data: TokenizeRequest) -> TokenizeResponse:
        text = data.text if data.text is not None else data.content
        if text is None:
            raise ApiError(ErrorCode.INVALID_REQUEST, "give text")
        add = data.add_special if data.add_special is not None else data.add_special_tokens
        res = await services.engine.tokenize(text, add, data.parse_special)
        body = TokenizeResponse(token_ids=res.ids, token_count=len(res.ids))
        if data.with_pieces is not False:
            pieces = [{"token_id": t, **_piece_fields(p)} for t, p in zip(res.ids, res.pieces, strict=True)]
            body.tokens = msgspec.convert(pieces, list[TokenText])
        return body

    @post(
        "/api/v1/detokenize",
        status_code=200,
        summary="Token ids to text",
        **json_route(DetokenizeRequest),
    )
    async def detokenize(self, services: Services, data: DetokenizeRequest) -> DetokenizeResponse:
        ids = data.token_ids if data.token_ids is not None else data.tokens
        if ids is None:
            raise ApiError(ErrorCode.INVALID_REQUEST, "give token_ids")
        check_tokens(ids, services.generation.info.vocab_size, "token_ids")
        return DetokenizeResponse(text=await services.engine.detokenize(ids))

    @post(
        "/tokenize",
        status_code=200,
        exception_handlers=COMPAT_ERRORS,
        summary="llama-server tokenize (content, add_special, with_pieces)",
        **json_route(TokenizeRequest, COMPAT_ERROR_RESPONSES),
    )
    async def ls_tokenize(self, services: Services, data: TokenizeRequest) -> LlamaTokenizeResponse:
        text = data.content if data.content is not None else data.text
        if text is None:
            raise ApiError(ErrorCode.INVALID_REQUEST, "give content")
        add = data.add_special if data.add_special is not None else data.add_special_tokens
        res = await services.engine.tokenize(text, add, data.parse_special)
        if not data.with_pieces:
            return LlamaTokenizeResponse(tokens=list(res.ids))
        pieces: list[int | TokenPiece] = []
        for t, p in zip(res.ids, res.pieces, strict=True):
            f = _piece_fields(p)
            pieces.append(TokenPiece(id=t, piece=f["text"] if "bytes" not in f else f["bytes"]))
        return LlamaTokenizeResponse(tokens=pieces)

    @post(
        "/detokenize",
        status_code=200,
        exception_handlers=COMPAT_ERRORS,
        summary="llama-server detokenize (tokens)",
        **json_route(DetokenizeRequest, COMPAT_ERROR_RESPONSES),
    )
    async def ls_detokenize(self, services: Services, data: DetokenizeRequest) -> LlamaDetokenizeResponse:
        ids = data.tokens if data.tokens is not None else data.token_ids
        if ids is None:
            raise ApiError(ErrorCode.INVALID_REQUEST, "give tokens")
        check_tokens(ids, services.generation.info.vocab_size, "tokens")
        return LlamaDetokenizeResponse(content=await services.engine.detokenize(ids))
