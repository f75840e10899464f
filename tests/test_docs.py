"""docs/api.md and docs/operations.md against the code: routes, request fields, error codes, CLI flags.

No server and no model: the app is built in-process (``create_app`` does not start the
engine worker; that happens in its lifespan) and its OpenAPI schema is compared with
the ``METHOD /path`` mentions in docs/api.md.  WebSocket routes are not in OpenAPI, so
``WS /path`` mentions are checked against the app's route list.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
from litestar.routes import WebSocketRoute

from contract.errors import ErrorCode
from orchestrator.api import stream_docs
from orchestrator.api.common import completion
from orchestrator.api.common import generate as common_generate
from orchestrator.api.kobold import protocol as kobold
from orchestrator.api.llama_server import protocol as llama_server
from orchestrator.api.native import protocol as native
from orchestrator.api.ollama import protocol as ollama
from orchestrator.api.openai import protocol as openai
from orchestrator.api.openai.responses import protocol as responses
from orchestrator.app import build_services, create_app
from orchestrator.cli import build_parser
from orchestrator.config import Settings
from orchestrator.generation import request as generation
from orchestrator.web.errors import STATUS_OF_CODE

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
OPS_MD = ROOT / "docs" / "operations.md"
HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
MENTION = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE|WS) (/[A-Za-z0-9_{}./-]*)")


def _normalize(path: str) -> str:
    """Litestar route paths carry converters (``{slot_id:str}``); OpenAPI and the docs do not."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


@pytest.fixture(scope="module")
def api_doc() -> str:
    return API_MD.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"))
    services = build_services(settings)
    application = create_app(settings, services)
    # Building the app must not start (or connect to) an engine worker.
    assert services.engine.pid is None and not services.engine.alive
    return application


@pytest.fixture(scope="module")
def openapi_ops(app) -> set[tuple[str, str]]:  # type: ignore[no-untyped-def]
    schema = app.openapi_schema.to_schema()
    return {(m.upper(), p) for p, item in schema["paths"].items() for m in item if m.upper() in HTTP_METHODS}


@pytest.fixture(scope="module")
def ws_paths(app) -> set[str]:  # type: ignore[no-untyped-def]
    return {_normalize(r.path) for r in app.routes if isinstance(r, WebSocketRoute)}


@pytest.fixture(scope="module")
def http_paths(app) -> set[str]:  # type: ignore[no-untyped-def]
    return {_normalize(r.path) for r in app.routes if not isinstance(r, WebSocketRoute)}


def _mentioned(doc: str, method: str, path: str) -> bool:
    return re.search(rf"\b{method} {re.escape(path)}(?![A-Za-z0-9_{{}}/-])", doc) is not None


def test_every_openapi_operation_is_documented(api_doc: str, openapi_ops: set[tuple[str, str]]) -> None:
    assert openapi_ops, "the OpenAPI schema lists no operations"
    missing = sorted(f"{m} {p}" for m, p in openapi_ops if not _mentioned(api_doc, m, p))
    assert not missing, f"not documented in docs/api.md: {missing}"


def test_every_websocket_route_is_documented(api_doc: str, ws_paths: set[str]) -> None:
    assert len(ws_paths) == 2, ws_paths
    missing = sorted(p for p in ws_paths if not _mentioned(api_doc, "WS", p))
    assert not missing, f"not documented in docs/api.md: {missing}"


def test_every_documented_endpoint_exists(
    api_doc: str, openapi_ops: set[tuple[str, str]], ws_paths: set[str], http_paths: set[str]
) -> None:
    mentions = {(m, p.rstrip(".")) for m, p in MENTION.findall(api_doc)}
    assert mentions
    unknown = []
    for method, path in sorted(mentions):
        if method == "WS":
            ok = path in ws_paths
        elif path == "/schema" or path.startswith("/schema/"):
            ok = path in http_paths  # the OpenAPI viewers are app routes, not schema operations
        else:
            ok = (method, path) in openapi_ops
        if not ok:
            unknown.append(f"{method} {path}")
    assert not unknown, f"docs/api.md documents endpoints the app does not have: {unknown}"


def _raised_codes() -> set[str]:
    """Every code either process can send: the whole ``ErrorCode`` vocabulary (``ServiceError``, ``ApiError`` and
    ``EngineError`` take nothing else), plus any string literal still raised in the source."""
    codes = {str(c) for c in ErrorCode} | {str(c) for c in STATUS_OF_CODE}
    for folder in ("orchestrator", "engine"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            codes.update(re.findall(r'(?:Api|Service|Engine)Error\(\s*"([A-Z_]+)"', text))
            codes.update(re.findall(r"ErrorCode\.([A-Z_]+)", text))
    return codes


def test_every_error_code_is_documented(api_doc: str) -> None:
    codes = _raised_codes()
    assert {"INVALID_TOKEN", "CONTEXT_OVERFLOW", "SLOT_BUSY", "NOT_FOUND", "OOM", "UNAUTHORIZED"} <= codes, codes
    missing = sorted(c for c in codes if f"`{c}`" not in api_doc)
    assert not missing, f"error codes missing from docs/api.md: {missing}"


REQUEST_BODIES = [
    common_generate.GenerateRequest,
    native.TokenizeRequest,
    native.DetokenizeRequest,
    generation.PreviewRequest,
    generation.AppendToken,
    llama_server.ContextShiftRequest,
    llama_server.SlotFileRequest,
    llama_server.ForkRequest,
    llama_server.RestoreStateRequest,
    openai.ChatCompletionRequest,
    openai.CompletionRequest,
    openai.StreamOptions,
    openai.AttentionOption,
    responses.ResponsesRequest,
    responses.TextFormat,
    completion.CompletionBody,
    completion.PromptObject,
    llama_server.ChatPromptBody,
    openai.EmbeddingsRequest,
    kobold.GenkeyBody,
    kobold.TokenCountBody,
    ollama.ChatRequest,
    ollama.GenerateRequest,
    ollama.Options,
    ollama.Message,
    ollama.Tool,
    ollama.ToolFunction,
    ollama.EmbedRequest,
    ollama.EmbeddingRequest,
    ollama.ShowRequest,
]


@pytest.mark.parametrize("struct", REQUEST_BODIES, ids=lambda s: s.__name__)
def test_every_request_field_is_documented(api_doc: str, struct: type[msgspec.Struct]) -> None:
    names = [f.encode_name for f in msgspec.structs.fields(struct)]
    missing = [n for n in names if f"`{n}`" not in api_doc and f'"{n}"' not in api_doc]  # prose or JSON example
    assert not missing, f"{struct.__name__} fields missing from docs/api.md: {missing}"


def test_every_serve_flag_is_documented() -> None:
    doc = OPS_MD.read_text(encoding="utf-8")
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]  # type: ignore[union-attr]
    flags = [max(a.option_strings, key=len) for a in serve._actions if a.option_strings and a.dest != "help"]
    assert "--redis-url" in flags
    missing = [f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", doc)]
    assert not missing, f"slotserve serve flags missing from docs/operations.md: {missing}"


def test_nothing_cites_documents_outside_the_repository() -> None:
    """Docstrings, comments and docs cite what a reader of the repository can open: never the
    project's design notes or seed documents, which are not in it."""
    root = ROOT
    pattern = re.compile(r"DESIGN\.md|\bseeds?[ _]?0\d\d\b|\bseeds/", re.IGNORECASE)
    offenders = []
    for folder in (
        "contract",
        "engine",
        "orchestrator",
        "slotstate",
        "storage",
        "benchmarks",
        "tests",
        "docs",
        "scripts",
    ):
        for path in (root / folder).rglob("*"):
            if path.suffix in {".py", ".md", ".c", ".js", ".html", ".sh"} and path.is_file():
                text = path.read_text(encoding="utf-8", errors="replace")
                offenders += [f"{path.relative_to(root)}:{m.group(0)}" for m in pattern.finditer(text)]
    readme = (root / "README.md").read_text(encoding="utf-8")
    offenders += [f"README.md:{m.group(0)}" for m in pattern.finditer(readme)]
    assert offenders == [], offenders


def test_the_stream_events_page_is_generated_from_the_structs() -> None:
    """docs/stream-events.md is what ``python -m orchestrator.api.stream_docs`` prints today."""
    page = (ROOT / "docs" / "stream-events.md").read_text()
    assert page == stream_docs.render(), "regenerate: python -m orchestrator.api.stream_docs > docs/stream-events.md"
    for _, events in stream_docs.STREAMS:
        for event in events:
            assert f"## {event.__name__}" in page
