"""Response header names in llama-server's capitalisation (``Access-Control-Allow-Origin``).

HTTP header names are case-insensitive (RFC 9110 section 5.1) and every HTTP client looks them
up so, but some code does not: llama.cpp's own server tests copy a response's headers into a
plain ``dict`` and look for ``Access-Control-Allow-Origin`` and ``Process-Start-Time-Unix``
(``tools/server/tests/unit/test_security.py``, ``test_metrics.py``), as llama-server writes
them (cpp-httplib keeps names as given).  Litestar and uvicorn write names in lower case:
uvicorn's httptools protocol lowers each name with ``name.lower()`` before writing it
(``uvicorn/protocols/http/httptools_impl.py``, ``RequestResponseCycle.send``).  The names
listed here are handed to it as :class:`_Canonical`, a ``bytes`` whose ``lower()`` is
itself, so they go out as written; uvicorn's own checks only concern ``Content-Length``,
``Transfer-Encoding`` and ``Connection``, which are left alone.  A server that lowers names
some other way (uvicorn's h11 protocol) sends them in lower case, which is still correct HTTP.
"""

from __future__ import annotations

from litestar.types import Message, Scope

CANONICAL_NAMES = (
    "Access-Control-Allow-Origin",
    "Access-Control-Allow-Credentials",
    "Access-Control-Allow-Methods",
    "Access-Control-Allow-Headers",
    "Access-Control-Expose-Headers",
    "Access-Control-Max-Age",
    "Process-Start-Time-Unix",
)
"""Names written in llama-server's capitalisation (``server-http.cpp``, ``server-context.cpp``)."""


class _Canonical(bytes):
    """A header name that stays as written when lowered (see the module docstring)."""

    def lower(self) -> bytes:
        return self


_BY_LOWER = {name.lower().encode(): _Canonical(name.encode()) for name in CANONICAL_NAMES}


async def canonical_header_names(message: Message, scope: Scope) -> None:
    """Litestar ``before_send`` hook: on ``http.response.start``, the names in
    :data:`CANONICAL_NAMES` (in any case) are replaced by their canonical form."""
    if message["type"] != "http.response.start":
        return
    headers = message.get("headers") or []
    message["headers"] = [(_BY_LOWER.get(bytes(k).lower(), k), v) for k, v in headers]
