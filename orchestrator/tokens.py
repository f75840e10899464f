"""Token ids checked against the model's vocabulary, for every path that takes ids from a client or a state."""

from __future__ import annotations

from collections.abc import Sequence

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError


def check_tokens(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """``INVALID_TOKEN`` unless every id is in ``[0, vocab_size)``."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ServiceError(
                ErrorCode.INVALID_TOKEN,
                f"Token ID {t} not in vocabulary (vocab_size={vocab_size}) in {what}",
                token_id=t,
            )
