"""``POST /classify`` and ``/v1/classify``: text classification in the TEI input format.

Request ``{"inputs": "text"}`` or ``{"inputs": ["a", "b"]}`` (Hugging Face Text
Embeddings Inference's ``/predict`` input).  Response (llama-server's classify
extension)::

    {"model": "...", "object": "list", "usage": {"prompt_tokens": N, "total_tokens": N},
     "predictions": [{"label": "POSITIVE", "score": 2.345}, ...]}

``score`` is the raw logit (no softmax); predictions are sorted by score, highest
first; for a list input ``predictions`` is a list of such lists, one per input, in
input order.  Served by the classifier worker (``--classifier-model PATH``); without
one the endpoints answer 400 ``NO_MODEL``.
"""

from __future__ import annotations

import numpy as np
from litestar import post

from contract.errors import ErrorCode
from orchestrator.api.native.protocol import ClassifyRequest, ClassifyResponse, ClassifyUsage, Prediction
from orchestrator.services import Services
from orchestrator.web.body import json_route
from orchestrator.web.errors import ApiError

MAX_INPUTS = 64  # inputs per request (TEI's --max-client-batch-size is 32 by default)


def ranked(labels: list[str], logits: np.ndarray) -> list[Prediction]:
    """``logits`` (``float32[n_out]``) as predictions sorted by score, highest first (stable on ties)."""
    order = np.argsort(-logits, kind="stable")
    return [Prediction(labels[i], float(logits[i])) for i in order]


@post(
    ["/classify", "/v1/classify"],
    status_code=200,
    summary="Classify text (TEI input; raw logits per label, best first)",
    **json_route(ClassifyRequest),
)
async def classify(data: ClassifyRequest, services: Services) -> ClassifyResponse:
    engine = services.classifier
    if engine is None:
        raise ApiError(
            ErrorCode.NO_MODEL, "no classifier model loaded: start the server with --classifier-model PATH", 400
        )
    texts = [data.inputs] if isinstance(data.inputs, str) else data.inputs
    if not texts:
        raise ApiError(ErrorCode.INVALID_REQUEST, "inputs must be a string or a non-empty list of strings")
    if len(texts) > MAX_INPUTS:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"at most {MAX_INPUTS} inputs per request, got {len(texts)}")
    result = await engine.classify(texts)
    assert engine.info is not None
    logits = np.frombuffer(result.logits, dtype=np.float32).reshape(len(texts), result.n_out)
    labels = engine.info.classifier_labels
    per_input = [ranked(labels, row) for row in logits]
    n = sum(result.n_tokens)
    return ClassifyResponse(
        model=engine.info.model_name,
        usage=ClassifyUsage(n, n),
        predictions=per_input[0] if isinstance(data.inputs, str) else per_input,
    )
