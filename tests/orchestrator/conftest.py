"""Fixtures shared by several of the orchestrator's test modules (the session's servers are in ``tests/conftest.py``).

* ``openai_client``: the real ``openai`` SDK's client of the shared ``server``'s ``/v1`` routes (one per module).
* ``store``: a :class:`tests.orchestrator.chunk_store.Store` for the incremental-state tests, once on the directory
  store and once on a prefix of the session's redis-server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.conftest import ServerProc
from tests.orchestrator.chunk_store import Store


@pytest.fixture(scope="module")
def openai_client(server: ServerProc):  # type: ignore[no-untyped-def]
    """``openai.OpenAI`` on ``server``'s ``/v1`` (no retries, 600 s timeout); skips when the SDK is not installed."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest_asyncio.fixture(params=["directory", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    s = Store(tmp_path / "state", url)
    yield s
    if s.raw is not None:
        await s.raw.aclose()
