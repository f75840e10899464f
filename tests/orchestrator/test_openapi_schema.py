"""The OpenAPI schema (``/schema/openapi.json``) documents every response: each operation's
success status and each error status it lists has a body schema with named fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.api.llama_server.protocol import SlotAction
from orchestrator.api.llama_server.slots import ACTIONS
from orchestrator.app import build_services, create_app
from orchestrator.config import Settings

METHODS = ("get", "post", "put", "patch", "delete")
PROBES = ("GET /health", "GET /v1/health", "GET /metrics")  # llama-server's: 200, or 503 with the health body
TEXT_TYPES = ("text/plain", "text/html", "text/event-stream", "application/octet-stream")


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    settings = Settings(state_dir=Path(tmp_path_factory.mktemp("state")))
    return create_app(settings, build_services(settings)).openapi_schema.to_schema()


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    return schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]  # type: ignore[no-any-return]


def _documents(schema: dict[str, Any], node: dict[str, Any]) -> bool:
    """True when ``node`` names its fields: an object with properties, an array of such, or a
    union of such (``{}`` or a bare ``{"type": "object"}`` documents nothing)."""
    node = _resolve(schema, node)
    if "oneOf" in node or "anyOf" in node:
        members = node.get("oneOf") or node["anyOf"]
        return bool(members) and all(_documents(schema, m) for m in members)
    if node.get("type") == "array":
        return _documents(schema, node.get("items", {}))
    return node.get("type") == "object" and bool(node.get("properties"))


def _operations(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{method.upper()} {path}", op)
        for path, item in schema["paths"].items()
        for method, op in item.items()
        if method in METHODS
    ]


def test_every_operation_documents_its_success_body(schema: dict[str, Any]) -> None:
    ops = _operations(schema)
    assert len(ops) >= 30, [name for name, _ in ops]
    undocumented = []
    for name, op in ops:
        success = [status for status in op["responses"] if status.startswith("2")]
        if len(success) != 1:
            undocumented.append(f"{name}: success statuses {success}")
            continue
        content = op["responses"][success[0]].get("content") or {}
        if not content:
            undocumented.append(f"{name} {success[0]}: no body")
        for media, body in content.items():
            if (
                media == "text/event-stream"
            ):  # the schema of each event (data, event, id, retry), as schemathesis reads it
                ok = _documents(schema, body.get("schema", {}))
            elif media in TEXT_TYPES:
                ok = _resolve(schema, body.get("schema", {})).get("type") == "string"
            else:
                ok = _documents(schema, body.get("schema", {}))
            if not ok:
                undocumented.append(f"{name} {success[0]} {media}: {body}")
    assert not undocumented, "\n".join(undocumented)


def test_every_documented_error_status_has_a_body_with_error_code(schema: dict[str, Any]) -> None:
    bad = []
    for name, op in _operations(schema):
        errors = {status: r for status, r in op["responses"].items() if int(status) >= 400}
        if name not in PROBES and not {"400", "404", "500", "503"} <= set(errors):
            bad.append(f"{name}: documents only {sorted(errors)}")
        for status, response in errors.items():
            body = response.get("content", {}).get("application/json", {}).get("schema", {})
            fields = _resolve(schema, body).get("properties", {})
            if "error_code" not in fields or "error" not in fields:
                bad.append(f"{name} {status}: {body}")
    assert not bad, "\n".join(bad)


def test_slot_actions_and_error_codes_are_enumerated(schema: dict[str, Any]) -> None:
    op = schema["paths"]["/slots/{slot_id}"]["post"]
    (action,) = [p for p in op["parameters"] if p["name"] == "action"]
    values = _resolve(schema, action["schema"]).get("enum")
    assert set(values) == {"save-state", "restore-state", "tokens", "context-shift", "save", "restore", "erase", "fork"}
    assert set(ACTIONS) == set(SlotAction) == set(values)  # one handler per action
    code = _resolve(schema, schema["components"]["schemas"]["ErrorBody"]["properties"]["error_code"])
    assert "SLOT_BUSY" in code["enum"] and "STORE_UNAVAILABLE" in code["enum"]
