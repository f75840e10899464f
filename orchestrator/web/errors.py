"""API errors: every failure a client sees is JSON with an ``error_code``.

The codes are :class:`contract.errors.ErrorCode` (docs/api.md, "Errors"); each has one HTTP
status, :data:`STATUS_OF_CODE`.  Body shape::

    {"error": "<message>", "error_code": "<CODE>", ...extra}

(the ``error`` key is what the JSON WebSocket's ``error`` event uses, docs/api.md).  Caller
mistakes are 4xx; a 500 only ever means a bug of ours.

Domain code raises :class:`orchestrator.service_error.ServiceError` (no HTTP in it); every exception
that reaches a client becomes an :class:`ApiError` in one place,
:func:`from_exception`, through :data:`TO_API_ERROR` (keyed by exception type, looked up
along the exception's MRO as Litestar looks up its ``exception_handlers``).
:func:`exception_handlers` builds Litestar's handler map from the same table; a handler
logs the refusal (:func:`report`: one info line for a 4xx, a traceback for a 5xx).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog
from litestar import MediaType, Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.openapi import ResponseSpec
from litestar.types import ExceptionHandlersMap, Send

from contract.errors import ErrorCode
from orchestrator.engine_client.interface import EngineDeadError, EngineRequestError
from orchestrator.service_error import ServiceError

log = structlog.get_logger("slotserve.api")
_QUERY = re.compile(r"\?\S*")

STATUS_OF_CODE: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_TOKEN: 400,
    ErrorCode.INVALID_GRAMMAR: 400,
    ErrorCode.CONTEXT_OVERFLOW: 400,
    ErrorCode.NO_CACHED_CONTEXT: 400,
    ErrorCode.BAD_STATE: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.SLOT_NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.SLOT_BUSY: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.CLIENT_GONE: 499,  # nginx's "client closed request": the client left while its request waited
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_SUPPORTED: 501,
    ErrorCode.NO_MODEL: 503,
    ErrorCode.OOM: 503,
    ErrorCode.STORE_UNAVAILABLE: 503,
}
"""The HTTP status of every :class:`ErrorCode` (a test checks that none is missing)."""

_CODE_OF_HTTP_STATUS = {
    401: ErrorCode.UNAUTHORIZED,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
}
"""Litestar's own refusals (``HTTPException`` by status) as codes; other 4xx are INVALID_REQUEST."""


class ErrorFields(msgspec.Struct, kw_only=True):
    """What every error body carries besides ``error``: ``error_code`` (one of the codes above)
    and the fields some codes add (docs/api.md, "Errors")."""

    error_code: ErrorCode
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


class ErrorEvent(ErrorFields, kw_only=True, omit_defaults=True, tag="error", tag_field="type"):
    """An error as a stream event (SSE, WebSocket): ``{"type": "error", "request_id", "error",
    "error_code", ...}``, the error body's fields; sent before a stream ends or a socket closes."""

    request_id: str | None
    error: str

    @classmethod
    def of(cls, err: ApiError, request_id: str | None = None) -> ErrorEvent:
        """The event of ``err`` (its extra fields that :class:`ErrorFields` names)."""
        extra = {k: v for k, v in err.extra.items() if k in ErrorFields.__struct_fields__}
        return cls(request_id=request_id, error=err.message, error_code=err.code, **extra)


class CompatError(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The inner ``error`` of llama-server's and OpenAI's error body: ``code`` (the HTTP status),
    ``message``, ``type`` (``invalid_request_error``, ``not_found_error``, ``exceed_context_size_error``...)."""

    code: int
    message: str
    type: str
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


class CompatErrorBody(ErrorFields, kw_only=True):
    """The error body on llama-server's and OpenAI's paths (``orchestrator/api/common/run.py``):
    ``{"error": {"code", "message", "type"}, "error_code", ...}`` (llama.cpp ``tools/server/README.md``,
    OpenAI's API reference, "Error codes"), with :class:`ErrorFields`."""

    error: CompatError


def _documented_statuses() -> dict[int, list[str]]:
    """Every error status a route may answer, with its codes (``CLIENT_GONE``: nobody reads it)."""
    out: dict[int, list[str]] = {}
    for code, status in STATUS_OF_CODE.items():
        if code is not ErrorCode.CLIENT_GONE:
            out.setdefault(status, []).append(code.value)
    return dict(sorted(out.items()))


def error_responses(body: type[msgspec.Struct]) -> dict[int, ResponseSpec]:
    """``responses=`` of a route: every error status a route may answer, with ``body`` (a Struct)."""
    return {
        status: ResponseSpec(body, description=f"error ({', '.join(codes)})", generate_examples=False)
        for status, codes in _documented_statuses().items()
    }


ERROR_RESPONSES = error_responses(ErrorBody)
"""``responses=`` of every route: the error statuses with :class:`ErrorBody`."""
COMPAT_ERROR_RESPONSES = error_responses(CompatErrorBody)
"""``responses=`` of the llama-server and OpenAI routes: the error statuses with :class:`CompatErrorBody`."""
STREAMABLE_COMPAT_RESPONSES = {
    **COMPAT_ERROR_RESPONSES,
    200: ResponseSpec(
        dict[str, Any],
        description="the completion; with ``stream: true`` server-sent events (text/event-stream) instead",
        generate_examples=False,
    ),
}


class ApiError(ServiceError):
    """A failure as the client is told it: a :class:`ServiceError` with its HTTP ``status``.

    ``status`` defaults to the code's (:data:`STATUS_OF_CODE`).  Route handlers and the web edge raise
    it; domain code raises :class:`ServiceError`, which :func:`from_exception` turns into one.
    """

    def __init__(self, code: ErrorCode, message: str, status: int | None = None, **extra: Any) -> None:
        super().__init__(code, message, **extra)
        self.status = status or STATUS_OF_CODE[self.code]

    def body(self) -> dict[str, Any]:
        """The JSON error body (also used for WS/SSE error events)."""
        return {"error": self.message, "error_code": self.code, **self.extra}


def _engine_request_error(exc: EngineRequestError) -> ApiError:
    try:
        code = ErrorCode(exc.code)
    except ValueError:  # a worker of another version: a bug to fix, not the client's mistake
        return ApiError(ErrorCode.INTERNAL, f"engine error with unknown code {exc.code!r}: {exc.message}")
    return ApiError(code, exc.message)


def _http_exception(exc: HTTPException) -> ApiError:
    code = _CODE_OF_HTTP_STATUS.get(exc.status_code)
    if code is None:
        code = ErrorCode.INVALID_REQUEST if exc.status_code < 500 else ErrorCode.INTERNAL
    return ApiError(code, str(exc.detail), status=exc.status_code)


def _validation_exception(exc: ValidationException) -> ApiError:
    # Litestar's detail names the URL with its query string, which may hold ?api_key=: cut it.
    message = _QUERY.sub("", str(exc.detail))
    return ApiError(ErrorCode.INVALID_REQUEST, message, extra=exc.extra)


def _recursion_error(exc: RecursionError) -> ApiError:
    # msgspec decodes nested JSON recursively: a body nested thousands deep (into an ``Any`` field
    # such as ``json_schema`` or ``messages``) is the client's, any other RecursionError a bug of ours.
    if "deserializing" in str(exc):
        return ApiError(ErrorCode.INVALID_REQUEST, "the JSON body nests too deep")
    return _internal(exc)


def _internal(exc: BaseException) -> ApiError:
    return ApiError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


TO_API_ERROR: dict[type[Exception], Callable[[Any], ApiError]] = {
    ApiError: lambda exc: exc,
    ServiceError: lambda exc: ApiError(exc.code, exc.message, **exc.extra),
    EngineRequestError: _engine_request_error,
    EngineDeadError: lambda exc: ApiError(ErrorCode.NO_MODEL, str(exc)),
    ValidationException: _validation_exception,
    HTTPException: _http_exception,
    RecursionError: _recursion_error,
    UnicodeDecodeError: lambda exc: ApiError(ErrorCode.INVALID_REQUEST, f"the request body is not UTF-8: {exc}"),
    Exception: _internal,
}
"""How each exception type becomes an :class:`ApiError` (the most derived type in the MRO wins)."""


def from_exception(exc: BaseException) -> ApiError:
    """The :class:`ApiError` for any exception raised while serving a request (:data:`TO_API_ERROR`)."""
    for cls in type(exc).__mro__:
        to_error = TO_API_ERROR.get(cls)
        if to_error is not None:
            return to_error(exc)
    return _internal(exc)


def report(exc: BaseException, route: str) -> ApiError:
    """:func:`from_exception`, logged: a refusal (4xx) as one info line (code, route, message),
    a failure (5xx) with its traceback.  ``route`` is ``"METHOD /path"`` (no query string: it
    may hold an API key)."""
    err = from_exception(exc)
    fields = {"error_code": err.code.value, "status": err.status, "route": route, "message": err.message}
    if err.status < 500:
        log.info("request refused", **fields)
    else:
        log.error("request failed", **fields, exc_info=exc)
    return err


def route_of(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """``"METHOD /path"`` of a request (``"WS /path"`` of a WebSocket), for logs."""
    return f"{connection.scope.get('method', 'WS')} {connection.scope.get('path', '')}"


def exception_handlers(render: Callable[[ApiError], Any]) -> ExceptionHandlersMap:
    """Litestar's ``exception_handlers`` for every type of :data:`TO_API_ERROR`: the error,
    reported (:func:`report`), answered as ``render(err)`` JSON, with ``Retry-After`` when the
    error carries ``retry_after``."""

    def handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        err = report(exc, route_of(request))
        retry = err.extra.get("retry_after")
        headers = {"Retry-After": str(retry)} if retry is not None else None
        return Response(render(err), status_code=err.status, media_type=MediaType.JSON, headers=headers)

    return dict.fromkeys(TO_API_ERROR, handler)


def _unknown_route(request: Request[Any, Any, Any], exc: NotFoundException) -> Response[Any]:
    """A path no route serves (or Litestar's own 404): llama-server's and OpenAI's error object
    (:func:`compat_error_body`, as llama-server answers an unknown path), except under slotserve's
    own ``/api/`` and ``/admin/`` paths (``{"error", "error_code"}``)."""
    err = report(exc, route_of(request))
    own = request.url.path.startswith(("/api/", "/admin"))
    body = err.body() if own else compat_error_body(err)
    return Response(body, status_code=err.status, media_type=MediaType.JSON)


EXCEPTION_HANDLERS = {**exception_handlers(ApiError.body), NotFoundException: _unknown_route}
"""The app's handlers: every error as ``{"error", "error_code"}`` JSON (an unknown path: see :func:`_unknown_route`)."""

ERROR_TYPE_OF_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    501: "not_supported_error",
    503: "unavailable_error",
}

COMPAT_ERROR_PATHS = (
    "/v1/",
    "/chat/",
    "/completion",
    "/models",
    "/props",
    "/slots",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/responses",
    "/embeddings",
)
"""Paths of OpenAI's and llama-server's APIs, whose errors take :func:`compat_error_body`'s shape
(docs/api.md, "Errors")."""


def compat_error_body(err: ApiError) -> dict[str, Any]:
    """``{"error": {"code": <HTTP status>, "message", "type"}, "error_code", ...}``: the error shape OpenAI and
    llama-server clients read (llama-server ``tools/server/server-common.cpp`` ``format_error_response``; OpenAI's
    API reference, "Error codes"), plus slotserve's ``error_code``."""
    if err.code is ErrorCode.CONTEXT_OVERFLOW:
        kind = "exceed_context_size_error"
    else:
        kind = ERROR_TYPE_OF_STATUS.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    inner: dict[str, Any] = {"code": err.status, "message": err.message, "type": kind}
    if err.code is ErrorCode.CONTEXT_OVERFLOW:
        inner["n_prompt_tokens"] = err.extra.get("context_length")
        inner["n_ctx"] = err.extra.get("n_ctx")
    return {"error": inner, "error_code": err.code, **err.extra}


async def send_error(send: Send, path: str, err: ApiError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer an HTTP request with ``err`` from ASGI middleware, before Litestar routes it (so before its
    exception handlers): JSON in the shape of ``path``'s API (:func:`compat_error_body` on
    :data:`COMPAT_ERROR_PATHS`, else :meth:`ApiError.body`), with ``headers`` added."""
    body = msgspec.json.encode(compat_error_body(err) if path.startswith(COMPAT_ERROR_PATHS) else err.body())
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": err.status, "headers": start})
    await send({"type": "http.response.body", "body": body, "more_body": False})
