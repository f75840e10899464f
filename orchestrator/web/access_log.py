"""One log line per HTTP response, not per streamed chunk.

Litestar's :class:`~litestar.middleware.logging.LoggingMiddleware` (``litestar/middleware/logging.py``,
``create_send_wrapper``) logs the response at every ``http.response.body`` message, so an SSE stream writes
one "HTTP Response" line per event (per generated token).  :class:`StreamLoggingMiddleware` logs it at the
first body message only (the status is known then, and a client that leaves mid-stream still gets its line);
later chunks pass straight through.
"""

from __future__ import annotations

from litestar.constants import HTTP_RESPONSE_BODY, HTTP_RESPONSE_START
from litestar.middleware.logging import LoggingMiddleware
from litestar.types import Message, Scope, Send
from litestar.utils.scope.state import ScopeState


class StreamLoggingMiddleware(LoggingMiddleware):
    """Litestar's logging middleware with one response line per response (see the module docstring);
    set as ``LoggingMiddlewareConfig.middleware_class``."""

    def create_send_wrapper(self, scope: Scope, send: Send) -> Send:
        """An ASGI ``send`` that logs the response once, at its first body message."""
        state = ScopeState.from_scope(scope)
        logged = False

        async def send_wrapper(message: Message) -> None:
            nonlocal logged
            if not logged:
                if message["type"] == HTTP_RESPONSE_START:
                    state.log_context[HTTP_RESPONSE_START] = message
                elif message["type"] == HTTP_RESPONSE_BODY:
                    state.log_context[HTTP_RESPONSE_BODY] = message
                    self.log_response(scope=scope)
                    state.log_context.clear()
                    logged = True
            await send(message)

        return send_wrapper
