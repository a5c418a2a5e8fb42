"""The one poll helper: wait for a condition with a generous deadline, never a fixed sleep.

``until(condition)`` calls ``condition()`` until it returns a truthy value and returns that value;
``await until_async(condition)`` does the same on the event loop (``condition`` may be a coroutine function).
Past the deadline both raise :class:`Deadline` (an ``AssertionError``) naming ``what`` was awaited.
The default deadline is generous (60 s): it only bounds a failure, a passing test never waits for it,
so a slow, shared machine cannot turn a test red (docs/operating.md "Tests").
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, overload

T = TypeVar("T")

#: The default deadline, seconds.
TIMEOUT_S = 60.0
#: The default pause between two calls of the condition, seconds.
INTERVAL_S = 0.02


class Deadline(AssertionError):
    """A polled condition did not hold in time."""


class _Clock:
    """One poll's deadline (monotonic seconds)."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout = timeout
        self.what = what
        self.deadline = time.monotonic() + timeout

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise Deadline(f"{self.what} not met within {self.timeout} s")


def until(
    condition: Callable[..., T | None],
    *,
    timeout: float = TIMEOUT_S,
    interval: float = INTERVAL_S,
    what: str = "condition",
) -> T:
    """Call ``condition()`` until it returns a truthy value, and return it.

    ``condition`` is called without arguments (``...``: mypy cannot match ``lambda a=a: ...`` to
    ``Callable[[], T]``); an exception it raises ends the poll (a process that exited, a failed assertion).

    Raises:
        Deadline: not met within ``timeout`` seconds.
    """
    clock = _Clock(timeout, what)
    while True:
        value = condition()
        if value:
            return value
        clock.check()
        time.sleep(interval)


@overload
async def until_async(
    condition: Callable[..., Awaitable[T | None]], *, timeout: float = ..., interval: float = ..., what: str = ...
) -> T: ...


@overload
async def until_async(
    condition: Callable[..., T | None], *, timeout: float = ..., interval: float = ..., what: str = ...
) -> T: ...


async def until_async(
    condition: Callable[..., Any],
    *,
    timeout: float = TIMEOUT_S,
    interval: float = INTERVAL_S,
    what: str = "condition",
) -> Any:
    """:func:`until` on the event loop: ``condition()`` may return an awaitable (a coroutine function), which
    is awaited; the loop keeps running between calls.

    Raises:
        Deadline: not met within ``timeout`` seconds.
    """
    clock = _Clock(timeout, what)
    while True:
        value: Any = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        clock.check()
        await asyncio.sleep(interval)


def at_once(coro: Coroutine[Any, Any, T]) -> T:
    """The result of ``coro`` if it finishes without suspending even once (no thread hop, no I/O wait).

    Raises:
        AssertionError: ``coro`` suspended (it is closed, never resumed).
    """
    try:
        coro.send(None)
    except StopIteration as finished:
        return finished.value
    coro.close()
    raise AssertionError("the call suspended: it waited for a thread or I/O")
