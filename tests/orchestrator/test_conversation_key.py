"""The conversation key and ``cache_salt`` every API surface hands the slot pick (unit tests): the
documented order (``prompt_cache_key``, ``metadata.user_id``, the session headers), the principal
from the request's scope, and bad values refused as ``INVALID_REQUEST`` when the body is decoded."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from contract.errors import ErrorCode
from orchestrator.api.anthropic.protocol import MessagesRequest
from orchestrator.api.common.generate import GenerateRequest
from orchestrator.api.openai.protocol import ChatCompletionRequest
from orchestrator.api.openai.responses.protocol import ResponsesRequest
from orchestrator.service_error import ServiceError
from orchestrator.tenants.conversation import SESSION_HEADERS, anthropic_user_id, conversation_key, identify
from orchestrator.tenants.principal import SCOPE_KEY, Principal


class FakeRequest:
    """What :func:`identify` reads of a Litestar request: ``headers`` and ``scope``."""

    def __init__(self, headers: dict[str, str], principal: Principal | None = None) -> None:
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.scope: dict[str, Any] = {"state": {SCOPE_KEY: principal} if principal else {}}


def test_the_body_keys_come_before_the_session_headers_in_order() -> None:
    headers = {name: f"h-{name}" for name in SESSION_HEADERS}
    assert conversation_key(headers, "pck", "uid") == "pck"
    assert conversation_key(headers, None, "uid") == "uid"
    assert conversation_key(headers, "", None) == "h-x-session-id"  # empty is absent
    for i, name in enumerate(SESSION_HEADERS):
        later = {n: f"h-{n}" for n in SESSION_HEADERS[i:]}
        assert conversation_key(later) == f"h-{name}"
    assert conversation_key({}) is None
    assert SESSION_HEADERS == ("x-session-id", "session_id", "x-claude-code-session-id", "x-opencode-session")


def test_a_header_key_over_256_characters_is_refused() -> None:
    with pytest.raises(ServiceError) as err:
        conversation_key({"x-session-id": "s" * 257})
    assert err.value.code == ErrorCode.INVALID_REQUEST


def test_identify_fills_the_principal_and_the_key() -> None:
    req = GenerateRequest(prompt="hi", cache_salt="salt-1").canonical()
    assert req.cache_salt == "salt-1" and req.conversation_key is None and req.principal == Principal()
    identify(req, FakeRequest({"X-Claude-Code-Session-Id": "cc-1"}, Principal("acme")))
    assert req.principal == Principal("acme") and req.conversation_key == "cc-1"


def test_anthropic_metadata_user_id() -> None:
    assert anthropic_user_id({"user_id": "u-1"}) == "u-1"
    assert anthropic_user_id(None) is None and anthropic_user_id({}) is None
    for bad in ({"user_id": 7}, {"user_id": "u" * 257}):
        with pytest.raises(ServiceError):
            anthropic_user_id(bad)


@pytest.mark.parametrize(
    ("cls", "body"),
    [
        (ChatCompletionRequest, {"messages": []}),
        (ResponsesRequest, {"input": "hi"}),
        (MessagesRequest, {"messages": []}),
        (GenerateRequest, {"prompt": "hi"}),
    ],
)
def test_every_generating_body_takes_cache_salt_and_refuses_a_bad_one(cls: type, body: dict[str, Any]) -> None:
    ok = msgspec.json.decode(msgspec.json.encode({**body, "cache_salt": "tenant-salt"}), type=cls)
    assert ok.cache_salt == "tenant-salt"
    for bad in ("", "s" * 257, 42):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode({**body, "cache_salt": bad}), type=cls)


def test_prompt_cache_key_is_bounded() -> None:
    body = {"messages": [], "prompt_cache_key": "k" * 257}
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)
