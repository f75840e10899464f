"""A standing fuzz test: schemathesis over the OpenAPI schema of a real running server.

Every HTTP operation of ``/schema/openapi.json`` gets cases generated from its schema, both
valid ones and ones that break it, sent to a real ``slotserve serve`` (real model, small
context so a generation is cheap).  Each answer must be no 5xx, a documented status, the
documented content type and a body that conforms to the schema (errors included:
``{"error", "error_code"}``); a case that breaks the schema must be refused with a 4xx.

Bounded for CI: ``SLOTSERVE_FUZZ_EXAMPLES`` cases per operation and mode (default 50), no
shrinking, valid cases generate at most a few tokens (:func:`cheap`), derandomized so a run
is reproducible (``SLOTSERVE_FUZZ_SEED`` picks other cases).
The case count and the time are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import ServerProc  # noqa: E402

EXAMPLES = int(os.environ.get("SLOTSERVE_FUZZ_EXAMPLES", "50"))
SEED = os.environ.get("SLOTSERVE_FUZZ_SEED")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("fuzz")
    args = ["--threads", "2", "--parallel", "2", "--spare", "2", "--ctx-size", "256",
            "--state-dir", str(work / "state"), "--slot-save-path", str(work / "slots")]  # fmt: skip
    srv = ServerProc(args, work).start()
    yield srv
    srv.stop()


LENGTHS = ("max_new_tokens", "max_length", "max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
CHEAP = 4
# generation routes -> the length field set when a valid case gives none
GENERATION_ROUTES = {
    "/api/v1/generate": "max_new_tokens",
    "/api/extra/generate/stream": "max_new_tokens",
    "/api/v1/generate/preview": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/completion": "n_predict",
    "/completions": "n_predict",
    "/v1/responses": "max_output_tokens",
    "/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}
# Ollama's generation routes: the length is options.num_predict (-1, -2: the whole window)
OLLAMA_ROUTES = ("/api/chat", "/api/generate")
# endless event streams (the admin page's feed): covered by the admin page test, not fuzzed
ENDLESS = ("/admin/events",)
# llama-server's and OpenAI's paths answer errors in their shape (CompatErrorBody)
COMPAT_PATHS = ("/v1/chat/", "/chat/", "/v1/completions", "/completion", "/v1/models", "/models", "/props",
                "/slots", "/v1/slots", "/tokenize", "/detokenize", "/v1/responses", "/responses", "/apply-template",
                "/v1/embeddings", "/embeddings")  # fmt: skip


def cheap(case: schemathesis.Case) -> None:
    """Bound the cost of a valid case: at most ``CHEAP`` tokens to generate.

    Long generations test the engine, not input handling, and take seconds each on a
    loaded CPU; values beyond the context still get their ``CONTEXT_OVERFLOW``.
    """
    body = case.body
    if isinstance(body, dict) and case.operation.path in OLLAMA_ROUTES:
        options = body["options"] = body.get("options") or {}
        if isinstance(options, dict):
            n = options.get("num_predict")
            options["num_predict"] = min(n, CHEAP) if isinstance(n, int) and 0 <= n <= 4096 else CHEAP
        body["stream"] = False
        return
    default = GENERATION_ROUTES.get(case.operation.path)
    if not isinstance(body, dict) or default is None:
        return
    lengths = [k for k in LENGTHS if isinstance(body.get(k), int)]
    for k in lengths:
        body[k] = min(body[k], CHEAP) if 0 <= body[k] <= 4096 else body[k]
    if not lengths:
        body[default] = CHEAP
    if body.get("stream") is True and case.operation.path != "/api/extra/generate/stream":
        body["stream"] = False  # the JSON answer; streamed answers have their own tests


def fuzz_operation(op: schemathesis.APIOperation, mode: GenerationMode, base_url: str, failures: list[str]) -> int:
    """Run ``EXAMPLES`` cases of ``op`` in ``mode``; append what fails to ``failures``; return the count."""
    checks = [*CHECKS, negative_data_rejection] if mode == GenerationMode.NEGATIVE else CHECKS
    label = f"{op.label} [{mode.value}]"
    n = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=SEED is None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        nonlocal n
        n += 1
        if mode == GenerationMode.POSITIVE:
            cheap(case)
        try:
            case.call_and_validate(base_url=base_url, checks=checks, timeout=60)
        except (AssertionError, BaseExceptionGroup, OSError) as exc:  # a check failed, or no answer
            failures.append(f"{label}: {str(exc)[:1500]}")

    try:
        (seed(int(SEED))(run) if SEED is not None else run)()
    except Unsatisfiable:  # nothing in the operation can break its schema (no parameters, no body)
        assert mode == GenerationMode.NEGATIVE, label
    return n


def test_schema_fuzz(fuzz_server: ServerProc) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/schema/openapi.json")
    operations = [op for op in (result.ok() for result in schema.get_all_operations()) if op.path not in ENDLESS]
    assert len(operations) >= 10, [op.label for op in operations]
    failures: list[str] = []
    t0 = time.monotonic()
    n_cases = sum(
        fuzz_operation(op, mode, fuzz_server.url, failures)
        for op in operations
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    )
    elapsed = time.monotonic() - t0
    print(f"\nschema fuzz: {n_cases} cases over {len(operations)} operations in {elapsed:.1f} s")
    assert fuzz_server.proc is not None and fuzz_server.proc.poll() is None, "the server died"
    where = sorted({f.split(": ", 1)[0] for f in failures})
    import os
    import pathlib

    if os.environ.get("FUZZ_DUMP"):
        pathlib.Path(os.environ["FUZZ_DUMP"]).write_text("\n\n=====\n\n".join(failures))
    assert not failures, f"{len(failures)} failing cases in {where}:\n\n" + "\n\n".join(failures[:8])


def test_schema_documents_the_real_error_body(server: ServerProc) -> None:
    """Every route's error statuses are ``{"error", "error_code"}`` in the schema, as sent."""
    schema = httpx.get(server.url + "/schema/openapi.json", timeout=30).json()
    body = schema["components"]["schemas"]["ErrorBody"]
    assert set(body["required"]) == {"error", "error_code"}
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if path in ("/health", "/v1/health", "/metrics"):
                continue
            compat = path == "/" or path.startswith(COMPAT_PATHS)  # "/": the chat page, outside /api/ and /admin
            expect = "/CompatErrorBody" if compat else "/ErrorBody"
            if path.startswith("/v1/messages"):  # llama-server's body with Anthropic's "type": "error"
                expect = "/MessageError"
            for status in ("400", "404", "409", "429", "503"):
                ref = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith(expect), (method, path, status)
    r = httpx.post(server.url + "/api/v1/tokenize", json={"text": 5}, timeout=30)
    assert r.status_code == 400 and {"error", "error_code"} <= set(r.json())
