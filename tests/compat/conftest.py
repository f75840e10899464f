"""Stop every slotserve a ported llama.cpp test started (as llama.cpp's tests/conftest.py does)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.compat.utils import server_instances


@pytest.fixture(autouse=True)
def stop_server_after_each_test() -> Iterator[None]:
    yield
    for server in set(server_instances):
        server.stop()
