"""The engine's exception: an operation on the model or its context failed, with the error code to answer.

Raised by the context (:mod:`engine.engine`) and the modules that work on it (state files, KV ranges, the
classifier); the worker answers it with an ``Error`` reply carrying its code (:mod:`contract.errors`).
"""

from __future__ import annotations

from contract.errors import ErrorCode


class EngineError(RuntimeError):
    """An operation failed, for the reason ``code`` (docs/api.md, "Errors")."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
