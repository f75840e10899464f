"""Who a generation request acts for and which conversation it continues: the one place every API
surface fills :class:`~orchestrator.generation.request.CanonicalRequest`'s ``principal``,
``cache_salt`` and ``conversation_key`` from.

The conversation key is what a client sends to keep a conversation on one slot without naming
the slot (docs/api.md, "Requests without a slot id"), taken in this order, the first present and
non-empty winning (explicit slot fields, ``slot_id``, ``id_slot``, ``conversation_id``,
``X-Slot-Id``, come before all of these; the slot pick sees them in ``CanonicalRequest.slot``):

1. OpenAI's ``prompt_cache_key`` (Chat Completions, Completions, Responses);
2. Anthropic's ``metadata.user_id`` (Messages);
3. the session headers agent clients send on every request, in :data:`SESSION_HEADERS` order:
   ``X-Session-Id``, ``session_id``, ``X-Claude-Code-Session-Id`` (Claude Code),
   ``x-opencode-session`` (OpenCode).

A key is scoped to the caller's tenant by the slot pick, never compared across tenants.
``cache_salt`` is vLLM's field (its OpenAI-compatible server, ``cache_salt``): caches are shared
only between requests of one tenant with equal salts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Protocol, TypeVar

import msgspec

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError
from orchestrator.tenants.principal import Principal, principal_of

MAX_KEY = 256
"""Longest conversation key and ``cache_salt``, characters."""

SESSION_HEADERS = ("x-session-id", "session_id", "x-claude-code-session-id", "x-opencode-session")
"""Session headers that name a conversation, in the order they are looked at (lower case)."""

CacheSalt = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_KEY,
        description="vLLM's cache_salt: KV caches are shared only between requests with the same salt",
    ),
]

PromptCacheKey = Annotated[
    str,
    msgspec.Meta(
        max_length=MAX_KEY, description="OpenAI's prompt_cache_key: keeps a conversation on one slot (docs/api.md)"
    ),
]


def conversation_key(headers: Mapping[str, str], *body_keys: str | None) -> str | None:
    """The conversation key of a request (module docstring): the first non-empty of ``body_keys``
    (``prompt_cache_key``, then ``metadata.user_id``), else of the session headers (``headers``:
    looked up by lower-case name).  ``INVALID_REQUEST`` for a header key over :data:`MAX_KEY`
    characters (the body fields are checked when decoded)."""
    for key in body_keys:
        if key:
            return key
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            if len(value) > MAX_KEY:
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"the {name} header is over {MAX_KEY} characters")
            return value
    return None


class Identified(Protocol):
    """What :func:`identify` fills (``CanonicalRequest``'s fields of the same names)."""

    principal: Principal
    conversation_key: str | None


R = TypeVar("R", bound=Identified)


def identify(req: R, request: Any, *body_keys: str | None) -> R:
    """Fill ``req``'s ``principal`` (the authentication middleware's, :func:`principal_of`) and
    ``conversation_key`` (:func:`conversation_key` of ``request``'s headers and ``body_keys``); the
    ``cache_salt`` came with the body.  ``request``: a Litestar ``Request`` or ``WebSocket``.
    Returns ``req``."""
    req.principal = principal_of(request)
    req.conversation_key = conversation_key(request.headers, *body_keys)
    return req


def anthropic_user_id(metadata: Mapping[str, Any] | None) -> str | None:
    """Anthropic's ``metadata.user_id`` (a string of at most :data:`MAX_KEY` characters, else
    ``INVALID_REQUEST``); None when absent."""
    value = (metadata or {}).get("user_id")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_KEY:
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"metadata.user_id: a string of at most {MAX_KEY} characters")
    return value
