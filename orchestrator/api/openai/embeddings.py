"""``POST /v1/embeddings`` (and ``/embeddings``): OpenAI's Embeddings API over llama.cpp's pooled
embeddings of the served model.

Request ``{"input": "text" | ["text", ...], "model"?, "encoding_format"?: "float" | "base64"}``
(OpenAI's API reference, "Create embeddings").  Response, as llama-server's
``format_embeddings_response_oaicompat`` (``tools/server/server-common.cpp``)::

    {"object": "list", "model": "...", "usage": {"prompt_tokens": N, "total_tokens": N},
     "data": [{"object": "embedding", "index": 0, "embedding": [float, ...] | "<base64>"}]}

Each vector is the input's pooled embedding (the model's own pooling, else mean: llama.cpp's
``llama_get_embeddings_seq``), L2-normalised as llama-server's ``/v1/embeddings`` does
(``embd_normalize`` 2); ``base64`` is the little-endian float32 bytes, as OpenAI's SDK asks for
by default.  Inputs are tokenized with the model's special tokens (BOS), as llama-cpp-python's
``Llama.embed`` does.  The embeddings come from a second worker loading the same model with a
pooled context, started on the first request (:mod:`orchestrator.engine_client.lazy`); ``--no-embeddings``
turns the endpoint off (``NOT_SUPPORTED``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from litestar import Controller, post

from contract.errors import ErrorCode
from orchestrator.api.common.run import COMPAT_ERRORS
from orchestrator.api.openai.protocol import Embedding, EmbeddingsRequest, EmbeddingsResponse, EmbeddingsUsage
from orchestrator.services import Services
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


def normalized(rows: np.ndarray) -> np.ndarray:
    """Each row divided by its Euclidean norm (a zero row stays zero): llama.cpp's
    ``common_embd_normalize`` with ``embd_norm`` 2."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def vector(row: np.ndarray, encoding: str) -> Any:
    """A row as the response carries it: floats, or base64 of its little-endian float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


class EmbeddingsController(Controller):
    """OpenAI's embeddings route (errors in OpenAI's ``{"error": {...}}`` shape)."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @post(
        ["/v1/embeddings", "/embeddings"],
        status_code=200,
        summary="OpenAI: embeddings of texts (pooled, L2-normalised)",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def embeddings(self, services: Services, data: EmbeddingsRequest) -> EmbeddingsResponse:
        if services.embedder is None:
            raise ApiError(ErrorCode.NOT_SUPPORTED, "embeddings are off (--no-embeddings)", 501)
        texts = [data.input] if isinstance(data.input, str) else data.input
        if not texts or len(texts) > MAX_INPUTS:
            raise ApiError(ErrorCode.INVALID_REQUEST, f"input must be a text or a list of 1..{MAX_INPUTS} texts")
        if any(not t for t in texts):
            raise ApiError(ErrorCode.INVALID_REQUEST, "input texts must not be empty")
        engine = await services.embedder.client()
        result = await engine.classify(texts)
        rows = normalized(np.frombuffer(result.logits, dtype=np.float32).reshape(len(texts), result.n_out))
        n = sum(result.n_tokens)
        return EmbeddingsResponse(
            object="list",
            model=services.model_id,
            data=[
                Embedding(object="embedding", index=i, embedding=vector(r, data.encoding_format))
                for i, r in enumerate(rows)
            ],
            usage=EmbeddingsUsage(prompt_tokens=n, total_tokens=n),
        )
