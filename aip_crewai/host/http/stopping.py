"""The host's shutdown signal to its own open requests: streams end, blocking waits answer.

Hypercorn waits for open connections before the app's lifespan shuts down
(on Python 3.12.1 and later ``asyncio.Server.wait_closed`` really waits), so a
tenant's open SSE stream, or a blocking call waiting for a long run, would
keep the host alive past systemd's stop timeout. At SIGTERM (or the first
SIGINT) ``host.main`` sets ``HostSetup.stopping``; then

- an SSE stream sends the comment :data:`SHUTDOWN_COMMENT` and ends without a
  terminal event; the tenant resumes on any host with ``Last-Event-ID``
  (every position is in the store);
- a blocking call answers at once with what it would answer at its own
  timeout: the action's ``ack`` (202), to be polled or followed later.

Source: docs/operating.md ("Operating under systemd"); ARCHITECTURE.md §8.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from ...sse import encode_comment

T = TypeVar("T")

#: Sent as the last bytes of a stream the host ended because it is shutting down.
SHUTDOWN_COMMENT = encode_comment("host shutting down; resume with Last-Event-ID")
#: Pause of a stream between reads of a store that cannot serve it now, seconds.
STORE_RETRY_S = 1.0


async def after_store_fault(silent_since: float, keepalive_s: float) -> bytes | None:
    """What a tenant's open stream does after a read of the store failed (``StoreUnavailable``: stopped,
    unreachable, past its bounds; the store logged it): pause :data:`STORE_RETRY_S`, then read again; the
    stream stays open, so the tenant sees the frames once the store answers, and no error ends a stream
    whose head was sent. Returns a keep-alive comment when the stream has written nothing since
    ``silent_since`` (``time.monotonic()``) for ``keepalive_s``, else None. docs/operating.md "Faults and
    their bounds"."""
    await asyncio.sleep(STORE_RETRY_S)
    return encode_comment("keep-alive") if time.monotonic() - silent_since >= keepalive_s else None


async def until_stopping(stopping: asyncio.Event, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Yield ``frames`` until they end or ``stopping`` is set, then :data:`SHUTDOWN_COMMENT`.

    The inner generator is cancelled at its current await (a store read or a
    wake-up wait: nothing it would send is lost, the store keeps it) and closed.
    """
    stop = asyncio.ensure_future(stopping.wait())
    step: asyncio.Future[bytes] | None = None
    try:
        while True:
            step = asyncio.ensure_future(frames.__anext__())
            done, _ = await asyncio.wait((step, stop), return_when=asyncio.FIRST_COMPLETED)
            if step in done:
                try:
                    frame = step.result()
                except StopAsyncIteration:
                    return
                step = None
                yield frame
                continue
            await _cancelled(step)
            step = None
            yield SHUTDOWN_COMMENT
            return
    finally:
        # Also when the client went away (the response task cancelled, or this generator closed)
        # while a frame was awaited: stop that await before closing the source.
        await _cancelled(stop)
        if step is not None:
            await _cancelled(step)
        await frames.aclose()  # type: ignore[attr-defined]


async def _cancelled(future: asyncio.Future[Any]) -> None:
    """Cancel ``future`` and wait until it has ended (its outcome is dropped)."""
    future.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
        await future


async def unless_stopping(stopping: asyncio.Event, waiting: Awaitable[T], fallback: T) -> T:
    """``await waiting``, or ``fallback`` (``waiting`` cancelled) once ``stopping`` is set."""
    wait = asyncio.ensure_future(waiting)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        done, _ = await asyncio.wait((wait, stop), return_when=asyncio.FIRST_COMPLETED)
        if wait in done:
            return wait.result()
        wait.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await wait
        return fallback
    finally:
        stop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stop
