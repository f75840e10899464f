"""API errors: every failure a client sees is JSON with an ``error_code``.

Codes (docs/api.md, "Errors"): INVALID_REQUEST, INVALID_TOKEN, CONTEXT_OVERFLOW,
NO_MODEL, OOM, SLOT_BUSY, SLOT_NOT_FOUND, NO_CACHED_CONTEXT, BAD_STATE, UNAUTHORIZED,
RATE_LIMITED, PAYLOAD_TOO_LARGE, STORE_UNAVAILABLE, NOT_SUPPORTED, CLIENT_GONE, INTERNAL.  Body shape::

    {"error": "<message>", "error_code": "<CODE>", ...extra}

(the ``error`` key is what the JSON WebSocket's ``error`` event uses, docs/api.md).  Caller mistakes are 4xx;
a 500 only ever means a bug of ours.
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import ResponseSpec

from orchestrator.engine_api import EngineDeadError, EngineRequestError

log = structlog.get_logger("slotserve.api")

STATUS_OF_CODE = {
    "INVALID_REQUEST": 400,
    "INVALID_TOKEN": 400,
    "CONTEXT_OVERFLOW": 400,
    "NO_CACHED_CONTEXT": 400,
    "BAD_STATE": 400,
    "UNAUTHORIZED": 401,
    "SLOT_NOT_FOUND": 404,
    "SLOT_BUSY": 409,
    "PAYLOAD_TOO_LARGE": 413,
    "RATE_LIMITED": 429,
    "CLIENT_GONE": 499,  # nginx's "client closed request": the client left while its request waited
    "INTERNAL": 500,
    "NOT_SUPPORTED": 501,
    "NO_MODEL": 503,
    "OOM": 503,
    "STORE_UNAVAILABLE": 503,
}


class ErrorFields(msgspec.Struct, kw_only=True):
    """What every error body carries besides ``error``: ``error_code`` (one of the codes above)
    and the fields some codes add (docs/api.md, "Errors")."""

    error_code: str
    token_id: int | None = None
    n_ctx: int | None = None
    context_length: int | None = None
    n_tokens: int | None = None
    slot_id: str | None = None
    owner: str | None = None
    retry_after: int | None = None
    extra: list[dict[str, Any]] | dict[str, Any] | None = None


class ErrorBody(ErrorFields, kw_only=True):
    """The JSON body of every error response (documents it in the OpenAPI schema): ``error`` is
    the message, with :class:`ErrorFields`."""

    error: str


class CompatError(msgspec.Struct, kw_only=True):
    """The inner ``error`` of llama-server's and OpenAI's error body: ``code`` (the HTTP status),
    ``message``, ``type`` (``invalid_request_error``, ``not_found_error``, ``exceed_context_size_error``...)."""

    code: int
    message: str
    type: str
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


class CompatErrorBody(ErrorFields, kw_only=True):
    """The error body on llama-server's and OpenAI's paths (``orchestrator/api/compat.py``):
    ``{"error": {"code", "message", "type"}, "error_code", ...}`` (llama.cpp ``tools/server/README.md``,
    OpenAI's API reference, "Error codes"), with :class:`ErrorFields`."""

    error: CompatError


def _responses(body: type[msgspec.Struct]) -> dict[int, ResponseSpec]:
    return {
        status: ResponseSpec(body, description=f"error ({', '.join(codes)})", generate_examples=False)
        for status, codes in _ERROR_STATUSES.items()
    }


_ERROR_STATUSES = {
    400: ["INVALID_REQUEST", "INVALID_TOKEN", "CONTEXT_OVERFLOW", "NO_CACHED_CONTEXT", "BAD_STATE"],
    401: ["UNAUTHORIZED"],
    404: ["SLOT_NOT_FOUND", "NOT_FOUND"],
    405: ["METHOD_NOT_ALLOWED"],
    409: ["SLOT_BUSY"],
    413: ["PAYLOAD_TOO_LARGE"],
    429: ["RATE_LIMITED"],
    500: ["INTERNAL"],
    503: ["NO_MODEL", "OOM", "STORE_UNAVAILABLE"],
}
ERROR_RESPONSES = _responses(ErrorBody)
"""``responses=`` of every route: the error statuses with :class:`ErrorBody`."""
COMPAT_ERROR_RESPONSES = _responses(CompatErrorBody)
STREAMABLE_COMPAT_RESPONSES = {
    **COMPAT_ERROR_RESPONSES,
    200: ResponseSpec(
        dict[str, Any],
        description="the completion; with ``stream: true`` server-sent events (text/event-stream) instead",
        generate_examples=False,
    ),
}
"""``responses=`` of the llama-server and OpenAI routes: the error statuses with :class:`CompatErrorBody`."""


class ApiError(Exception):
    """A failure to report to the client: ``code`` (above), message, optional extra fields."""

    def __init__(self, code: str, message: str, status: int | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status or STATUS_OF_CODE.get(code, 400)
        self.extra = extra

    def body(self) -> dict[str, Any]:
        """The JSON error body (also used for WS/SSE error events)."""
        return {"error": self.message, "error_code": self.code, **self.extra}


def from_exception(exc: BaseException) -> ApiError:
    """Map any exception raised while serving a request to an :class:`ApiError`."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineRequestError):
        return ApiError(exc.code, exc.message)
    if isinstance(exc, EngineDeadError):
        return ApiError("NO_MODEL", str(exc))
    if isinstance(exc, ValidationException):
        return ApiError("INVALID_REQUEST", str(exc.detail), extra=exc.extra)
    if isinstance(exc, HTTPException):
        code = {401: "UNAUTHORIZED", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "PAYLOAD_TOO_LARGE"}.get(
            exc.status_code, "INVALID_REQUEST" if exc.status_code < 500 else "INTERNAL"
        )
        return ApiError(code, str(exc.detail), status=exc.status_code)
    log.exception("unhandled error", error=str(exc))
    return ApiError("INTERNAL", f"{type(exc).__name__}: {exc}", status=500)


def exception_handler(_: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """Litestar exception handler: every error as ``{"error", "error_code"}`` JSON."""
    err = from_exception(exc)
    retry = err.extra.get("retry_after")
    headers = {"Retry-After": str(retry)} if retry is not None else None
    return Response(err.body(), status_code=err.status, media_type=MediaType.JSON, headers=headers)
