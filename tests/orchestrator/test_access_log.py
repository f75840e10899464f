"""One "HTTP Response" log line per streamed response (orchestrator/web/access_log.py), on the app's own
logging configuration and on a real server's SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from litestar import Litestar, get
from litestar.logging.config import StructLoggingConfig
from litestar.middleware.logging import LoggingMiddleware, LoggingMiddlewareConfig
from litestar.plugins.structlog import StructlogConfig, StructlogPlugin
from litestar.response import Stream
from litestar.testing import TestClient
from structlog.testing import capture_logs

from orchestrator.app import RESPONSE_LOG_FIELDS
from orchestrator.web.access_log import StreamLoggingMiddleware
from tests.conftest import ServerProc
from tests.orchestrator.client import sse_events, tokenize


@get("/chunks")
async def chunks() -> Stream:
    async def gen() -> AsyncIterator[bytes]:
        for i in range(7):
            yield f"data: {i}\n\n".encode()

    return Stream(gen(), media_type="text/event-stream")


def response_lines(middleware: type[LoggingMiddleware]) -> list[dict[str, object]]:
    config = LoggingMiddlewareConfig(response_log_fields=RESPONSE_LOG_FIELDS, middleware_class=middleware)
    app = Litestar(
        [chunks],
        plugins=[StructlogPlugin(StructlogConfig(StructLoggingConfig(), middleware_logging_config=config))],
    )
    with TestClient(app) as client, capture_logs() as logs:
        r = client.get("/chunks")
        assert r.status_code == 200 and r.text.count("data:") == 7
    return [e for e in logs if e.get("event") == "HTTP Response"]


def test_a_stream_of_seven_chunks_logs_one_response_line() -> None:
    lines = response_lines(StreamLoggingMiddleware)
    assert len(lines) == 1 and lines[0]["status_code"] == 200
    assert len(response_lines(LoggingMiddleware)) == 8  # Litestar's own: a line per body message


def test_an_sse_generation_logs_one_response_line(server: ServerProc) -> None:
    ids = tokenize(server.url, "<|im_start|>user\nCount to ten.<|im_end|>\n<|im_start|>assistant\n")

    def n_lines() -> int:
        return server.log_path.read_text(errors="replace").count('"event":"HTTP Response"')

    before = n_lines()
    body = {"input_ids": ids, "max_new_tokens": 12, "ignore_eos": True, "temperature": 0, "id_slot": "log-1"}
    events = sse_events(server.url, {**body, "output_attentions": True, "attention_format": "aggregated"})
    assert sum(e.get("type") == "token" for e in events) == 12
    httpx.get(server.url + "/health", timeout=30)  # one more line: the SSE response's came before it
    assert n_lines() - before == 2
