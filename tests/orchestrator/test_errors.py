"""One error vocabulary: every ``ErrorCode`` has an HTTP status and a row in docs/api.md,
exceptions map to codes by type, and refusals are logged as one line (no traceback)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import structlog
from litestar import Litestar, get
from litestar.exceptions import MethodNotAllowedException, NotFoundException, ValidationException
from litestar.testing import TestClient
from structlog.testing import capture_logs

from contract.errors import ErrorCode
from orchestrator.engine_client.client import EngineDeadError, EngineRequestError
from orchestrator.web.errors import EXCEPTION_HANDLERS, STATUS_OF_CODE, ApiError, from_exception
from tests.conftest import ServerProc

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _documented_statuses() -> dict[str, int]:
    """``error_code`` -> HTTP status from the table of docs/api.md's "Errors" section."""
    text = API_MD.read_text(encoding="utf-8")
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    return {code: int(status) for code, status in re.findall(r"^\| `([A-Z_]+)` \| (\d{3}) \|", section, re.M)}


def test_every_code_has_a_status_and_a_documented_row() -> None:
    assert set(STATUS_OF_CODE) == set(ErrorCode)
    assert all(400 <= s < 600 for s in STATUS_OF_CODE.values())
    assert _documented_statuses() == {code.value: status for code, status in STATUS_OF_CODE.items()}


def test_an_unknown_code_is_never_a_silent_400() -> None:
    with pytest.raises(ValueError):
        ApiError("NO_SUCH_CODE", "x")  # type: ignore[arg-type]
    err = from_exception(EngineRequestError("NO_SUCH_CODE", "from a worker of another version"))
    assert (err.code, err.status) == (ErrorCode.INTERNAL, 500)
    assert "NO_SUCH_CODE" in err.message


@pytest.mark.parametrize(
    ("exc", "code", "status"),
    [
        (ApiError(ErrorCode.SLOT_BUSY, "busy", slot_id="3"), ErrorCode.SLOT_BUSY, 409),
        (EngineRequestError("OOM", "no room"), ErrorCode.OOM, 503),
        (EngineRequestError(ErrorCode.INVALID_TOKEN, "bad id"), ErrorCode.INVALID_TOKEN, 400),
        (EngineDeadError("worker gone"), ErrorCode.NO_MODEL, 503),
        (ValidationException("bad field", extra=[{"key": "x"}]), ErrorCode.INVALID_REQUEST, 400),
        (NotFoundException("no route"), ErrorCode.NOT_FOUND, 404),
        (MethodNotAllowedException("no GET"), ErrorCode.METHOD_NOT_ALLOWED, 405),
        (KeyError("bug"), ErrorCode.INTERNAL, 500),
    ],
)
def test_exceptions_map_by_type(exc: Exception, code: ErrorCode, status: int) -> None:
    err = from_exception(exc)
    assert (err.code, err.status) == (code, status)
    assert err.body()["error_code"] == code.value


@get("/busy", sync_to_thread=False)
def _busy() -> None:
    raise ApiError(ErrorCode.SLOT_BUSY, "slot '3' is processing another request", slot_id="3")


@get("/bug", sync_to_thread=False)
def _bug() -> None:
    raise RuntimeError("a bug of ours")


def test_refusals_log_one_info_line_failures_a_traceback() -> None:
    structlog.reset_defaults()  # another test may have configured (and cached) structlog
    app = Litestar([_busy, _bug], exception_handlers=EXCEPTION_HANDLERS)
    with TestClient(app) as client, capture_logs() as logs:
        busy = client.get("/busy?api_key=secret")
        bug = client.get("/bug")
    assert busy.status_code == 409 and busy.json()["error_code"] == "SLOT_BUSY"
    assert bug.status_code == 500 and bug.json()["error_code"] == "INTERNAL"
    refused = [e for e in logs if e.get("route") == "GET /busy"]
    assert refused == [
        {
            "event": "request refused",
            "log_level": "info",
            "error_code": "SLOT_BUSY",
            "status": 409,
            "route": "GET /busy",
            "message": "slot '3' is processing another request",
        }
    ]
    failed = [e for e in logs if e.get("route") == "GET /bug"]
    assert len(failed) == 1 and failed[0]["log_level"] == "error"
    assert isinstance(failed[0]["exc_info"], RuntimeError)


def test_validation_messages_carry_no_query_string() -> None:
    exc = ValidationException("Validation failed for POST /slots/0?api_key=k3y&action=nope", extra=[{"key": "action"}])
    err = from_exception(exc)
    assert err.message == "Validation failed for POST /slots/0" and err.extra == {"extra": [{"key": "action"}]}


def test_real_server_logs_refusals_without_traceback(server: ServerProc) -> None:
    start = server.log_path.stat().st_size
    r = httpx.post(server.url + "/slots/no-such-slot", params={"action": "tokens"}, timeout=30)
    assert r.status_code == 404 and r.json()["error_code"] == "SLOT_NOT_FOUND"
    r = httpx.post(server.url + "/api/v1/tokenize", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"
    r = httpx.get(server.url + "/api/v1/tokenize", timeout=30)
    assert r.status_code == 405 and r.json()["error_code"] == "METHOD_NOT_ALLOWED"
    with server.log_path.open("rb") as f:
        f.seek(start)
        log = f.read().decode("utf-8", "replace")
    refusals = [line for line in log.splitlines() if "request refused" in line]
    assert len(refusals) == 3, log
    for line, code in zip(refusals, ("SLOT_NOT_FOUND", "INVALID_REQUEST", "METHOD_NOT_ALLOWED"), strict=True):
        assert code in line, line
    assert "Traceback" not in log and "Uncaught exception" not in log, log
