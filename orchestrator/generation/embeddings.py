"""Pooled embeddings of texts from the embeddings worker, for every API surface that serves them
(OpenAI's ``/v1/embeddings``, Ollama's ``/api/embed`` and ``/api/embeddings``).

The worker loads the served model again with a pooled context (llama.cpp's ``llama_get_embeddings_seq``:
the model's own pooling, else mean), started on the first request and stopped after
``--embeddings-keep-alive`` idle seconds (:class:`orchestrator.engine_client.lazy.LazyWorker`);
``--no-embeddings`` leaves none.
"""

from __future__ import annotations

import numpy as np

from contract.errors import ErrorCode
from orchestrator.engine_client.lazy import LazyWorker
from orchestrator.service_error import ServiceError


def normalized(rows: np.ndarray) -> np.ndarray:
    """Each row of ``rows`` (float ``[n, dim]``) divided by its Euclidean norm (a zero row stays zero), as
    float32: llama.cpp's ``common_embd_normalize`` with ``embd_norm`` 2."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.where(norms > 0, norms, 1.0)).astype(np.float32)


async def pooled(embedder: LazyWorker | None, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """The pooled embeddings of ``texts`` (float32 ``[len(texts), n_embd]``, not normalized) and each text's
    token count; ``embedder`` None (``--no-embeddings``): ``NOT_SUPPORTED``."""
    if embedder is None:
        raise ServiceError(ErrorCode.NOT_SUPPORTED, "embeddings are off (--no-embeddings)")
    async with embedder.use() as engine:
        result = await engine.classify(texts)
    return np.frombuffer(result.logits, dtype=np.float32).reshape(len(texts), result.n_out), list(result.n_tokens)
