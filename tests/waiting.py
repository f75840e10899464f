"""Waiting for a condition instead of sleeping for a guessed time.

A test that sleeps and then asserts fails on a loaded machine where the awaited thing takes
longer than the sleep. These helpers poll a condition until it holds; the deadline only bounds
a hang (generous, never a speed requirement: speed is for ``benchmarks/``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: Seconds a condition may take before the test fails as hung (not a speed requirement).
DEADLINE_S = 60.0


def wait_until(check: Callable[[], T], what: str, timeout: float = DEADLINE_S, interval: float = 0.05) -> T:
    """Call ``check()`` every ``interval`` seconds until it returns a truthy value, and return that value.

    Raises ``AssertionError`` naming ``what`` when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        time.sleep(interval)
    return value


async def async_wait_until(
    check: Callable[[], T | Awaitable[T]], what: str = "condition", timeout: float = DEADLINE_S, interval: float = 0.01
) -> T:
    """:func:`wait_until` for the event loop: ``check()`` (a plain or a coroutine function) is called
    between ``asyncio.sleep(interval)`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        await asyncio.sleep(interval)
