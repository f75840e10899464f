"""The chat page: ``GET /`` (the HTML) and its assets under ``/webui/`` (scripts, stylesheet).

The page is plain static files shipped in the package (``orchestrator/webui/static``: HTML, ES module
scripts, CSS; no build step, nothing fetched from elsewhere) and talks to the server only through the
public API, with the API key the user types in (kept in the tab's ``sessionStorage``):
``GET /api/v1/model``, ``POST /apply-template``, ``POST /api/v1/tokenize``, the binary WebSocket
``/api/extra/generate/stream/ws`` with attention, ``GET /slots`` and ``POST /slots/{id}?action=...``.
Every answer is therefore scoped to the caller's tenant exactly as that API scopes it; nothing here
reads a slot.  The page and its assets are public (they hold no data), as llama-server's web UI is.

``--no-webui`` (llama-server's ``--no-ui``/``--no-webui``, ``common/arg.cpp``) registers none of this, so
``GET /`` answers 404 ``NOT_FOUND``, as llama-server's test ``test_no_ui`` expects
(``tools/server/tests/unit/test_basic.py``).  docs/webui.md describes the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import MediaType, Response, get
from litestar.datastructures import CacheControlHeader
from litestar.static_files import create_static_files_router

from orchestrator.web.errors import COMPAT_ERROR_RESPONSES

STATIC_DIR = Path(__file__).resolve().parent / "static"
"""The page's files: ``index.html``, ``*.js`` (ES modules), ``webui.css``."""

ASSETS_PATH = "/webui"
"""Where the page's scripts and stylesheet are served (``/webui/chat.js``, ...); public, as ``/`` is
(:data:`orchestrator.web.auth.PUBLIC_PATHS` and ``PUBLIC_PREFIXES`` name both)."""

_NO_CACHE = CacheControlHeader(no_cache=True)  # revalidate: an upgraded server serves new scripts at once


@get(
    "/",
    summary="The chat page (HTML; --no-webui: 404)",
    media_type=MediaType.HTML,
    cache_control=_NO_CACHE,
    responses=COMPAT_ERROR_RESPONSES,  # a path outside /api/ and /admin: llama-server's error shape
)
async def page() -> Response[bytes]:
    """The chat page's HTML (``static/index.html``), ``text/html; charset=utf-8``."""
    return Response((STATIC_DIR / "index.html").read_bytes(), media_type="text/html; charset=utf-8")


def webui_handlers() -> list[Any]:
    """The route handlers to register for the page: ``GET /`` and the static router of ``/webui/*``."""
    assets = create_static_files_router(
        path=ASSETS_PATH,
        directories=[STATIC_DIR],
        name="webui",
        include_in_schema=False,
        cache_control=_NO_CACHE,
    )
    return [page, assets]
