"""Fixtures shared by several of the orchestrator's test modules (the session's servers are in ``tests/conftest.py``).

* ``openai_client``: the real ``openai`` SDK's client of the shared ``server``'s ``/v1`` routes (one per module).
"""

from __future__ import annotations

import pytest

from tests.conftest import ServerProc


@pytest.fixture(scope="module")
def openai_client(server: ServerProc):  # type: ignore[no-untyped-def]
    """``openai.OpenAI`` on ``server``'s ``/v1`` (no retries, 600 s timeout); skips when the SDK is not installed."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
