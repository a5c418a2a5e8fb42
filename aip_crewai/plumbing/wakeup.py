"""The one wake-up primitive of live followers (host SSE streams, sidecar job followers).

A follower must never miss a change that happens between its read of the
state and its wait. The rule: register interest first (take
:meth:`ChangeSignal.changed`, or remember :attr:`ChangeSignal.version`),
then read, then wait on what it took. A change after that point has already
set the event (or bumped the version), so the wait returns at once.
:func:`cancel_all` ends such followers and other background tasks at shutdown.

Every bounded wait in the package is ``anyio.fail_after`` or ``anyio.move_on_after`` around the await,
never ``asyncio.wait_for``: before Python 3.12 that returns the result of an awaitable completing as its
caller is cancelled and drops the cancellation, so a loop around it never stops (tests/architecture).

Source: docs/ARCHITECTURE.md §10 (live followers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import anyio


class ChangeSignal:
    """A change counter with an event per generation (event-loop only; no locks)."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def changed(self) -> asyncio.Event:
        """The event set at the next change; take it BEFORE reading the state."""
        return self._event

    def notify(self) -> None:
        """A change happened: wake every waiter and start a new generation."""
        self.version += 1
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, timeout_s: float, *, seen: int | None = None) -> bool:
        """Wait for a change after version ``seen`` (None: the next change).

        Returns True at once when a change already happened after ``seen``;
        False when ``timeout_s`` seconds pass without one.
        """
        if seen is not None and self.version != seen:
            return True
        with anyio.move_on_after(timeout_s):
            await self._event.wait()
            return True
        return False


#: Between two rounds of cancellation of tasks that have not ended, seconds.
CANCEL_ROUND_S = 0.5


async def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling again each :data:`CANCEL_ROUND_S`
    those still running: on Python before 3.12 ``asyncio.wait_for`` can swallow a cancellation that
    arrives as its awaitable completes, and a loop around such a wait would run on and hold a shutdown
    forever. Exceptions of the tasks are retrieved (not raised)."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_ROUND_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
