"""The one exception the orchestrator's domain code raises: :class:`ServiceError`.

Slots, generation and the engine client side refuse or fail with an :class:`contract.errors.ErrorCode`,
a message and extra fields a client may read (``slot_id``, ``retry_after``, ``n_ctx``...).  They know
nothing of HTTP: the web edge (:mod:`orchestrator.web.errors`) maps every exception to a status and a
body in one place (``TO_API_ERROR``), so a WebSocket error frame, an SSE error event and an HTTP
response carry the same code for the same failure.
"""

from __future__ import annotations

from typing import Any

from contract.errors import ErrorCode


class ServiceError(Exception):
    """A refusal or failure of the service: ``code`` (an :class:`ErrorCode`, or its exact name: anything
    else raises ``ValueError`` here, never a silent 400), ``message``, and ``extra`` fields for the
    client (docs/api.md, "Errors")."""

    def __init__(self, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.extra = extra
