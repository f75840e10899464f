"""The error vocabulary shared by the engine worker and the orchestrator.

Every failure either process reports carries one :class:`ErrorCode`.  The engine
sends it in its ``Error`` reply (``contract/protocol.py``); the orchestrator maps
each code to one HTTP status (``orchestrator/web/errors.py``) and documents them all in
docs/api.md ("Errors").  A ``StrEnum``: a code is its own name on the wire and in
JSON bodies, so clients see plain strings such as ``"SLOT_BUSY"``.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request failed (docs/api.md, "Errors")."""

    INVALID_REQUEST = "INVALID_REQUEST"  # the request is malformed or out of range
    INVALID_TOKEN = "INVALID_TOKEN"  # a token id outside the vocabulary
    INVALID_GRAMMAR = "INVALID_GRAMMAR"  # a grammar (GBNF) or JSON schema llama.cpp cannot use
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"  # more tokens than the slot's context window
    NO_CACHED_CONTEXT = "NO_CACHED_CONTEXT"  # the slot holds no context to continue or preview
    BAD_STATE = "BAD_STATE"  # a saved state this engine cannot take
    UNAUTHORIZED = "UNAUTHORIZED"  # missing or wrong API key
    FORBIDDEN = "FORBIDDEN"  # the request's Origin (a web page) is not allowed
    NOT_FOUND = "NOT_FOUND"  # no such route or resource
    SLOT_NOT_FOUND = "SLOT_NOT_FOUND"  # no such slot (nor a stored state of it)
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"  # the route exists, the method does not
    SLOT_BUSY = "SLOT_BUSY"  # another request or node holds the slot
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"  # body, headers or message over the size limit
    REQUEST_TIMEOUT = "REQUEST_TIMEOUT"  # the request's headers or body did not arrive in time
    RATE_LIMITED = "RATE_LIMITED"  # the admission queue or the spare sequences are full
    CLIENT_GONE = "CLIENT_GONE"  # the client left while its request waited
    INTERNAL = "INTERNAL"  # a bug of ours
    NOT_SUPPORTED = "NOT_SUPPORTED"  # the model or build cannot do this
    NO_MODEL = "NO_MODEL"  # the engine is not (yet) running
    OOM = "OOM"  # no room in the KV cache
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"  # the state store failed or timed out
