"""The one SQLite worker thread both storage layers use (host store, sidecar journal).

A connection is created, used and closed on one dedicated thread (sqlite3
objects must stay on the thread that made them); callers hop to it once per
storage method. :func:`start_worker` opens the connection on that thread and
is safe to cancel: when the caller gives up mid-open (task cancelled, or the
open failed), the worker shuts down and whatever the open produced is handed
to ``abandon`` on the worker after the open has finished, so no connection,
thread or lock outlives a failed or cancelled open.

Source: docs/ARCHITECTURE.md "Storage".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")


async def start_worker(open_: Callable[[], _T], *, name: str,
                       abandon: Callable[[_T | None], None]) -> tuple[ThreadPoolExecutor, _T]:
    """Start a one-thread executor and run ``open_()`` on it.

    Args:
        open_: opens (and prepares) the connection; runs on the worker.
        name: thread name prefix (visible in tracebacks and py-spy).
        abandon: cleanup when the caller does not get the result: called on the
            worker with what ``open_`` returned, or with None when it raised
            (it closed its own connection then); it may release locks.

    Returns:
        ``(worker, value)``: the worker that now owns the connection.

    Raises:
        Whatever ``open_`` raised, or CancelledError; nothing leaks either way.
    """
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    opening = worker.submit(open_)
    try:
        return worker, await asyncio.wrap_future(opening)
    except BaseException:
        worker.submit(_abandon, opening, abandon)  # runs after open_ (one thread, FIFO)
        worker.shutdown(wait=False)
        raise


def _abandon(opening: Future[_T], abandon: Callable[[_T | None], None]) -> None:
    value = opening.result() if not opening.cancelled() and opening.exception() is None else None
    abandon(value)
