"""Fixtures of the engine tests (the ``model`` and ``engine`` fixtures are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.engine.enginekit import Runner


@pytest.fixture
def runner(engine):  # type: ignore[no-untyped-def]
    """A :class:`Runner` over the shared engine with every slot erased before and after the test.

    Modules that share one runner across their tests define their own ``runner`` fixture.
    """
    for s in range(engine.config.n_slots):
        engine.erase(s)
    yield Runner(engine)
    for s in range(engine.config.n_slots):
        engine.erase(s)
