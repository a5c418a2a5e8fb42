"""host.stopping: streams end and blocking waits answer once the host is stopping."""

from __future__ import annotations

import asyncio

import pytest

from aip_crewai.host.http.stopping import SHUTDOWN_COMMENT, unless_stopping, until_stopping

pytestmark = pytest.mark.timeout(10)


async def test_a_stream_ends_with_the_shutdown_comment_and_its_source_is_closed() -> None:
    stopping = asyncio.Event()
    gate = asyncio.Event()
    closed = asyncio.Event()

    async def frames():
        try:
            yield b"one"
            await gate.wait()  # a follower waiting for news that never comes
            yield b"never"
        finally:
            closed.set()

    received = []
    async for frame in until_stopping(stopping, frames()):
        received.append(frame)
        stopping.set()
    assert received == [b"one", SHUTDOWN_COMMENT]
    assert closed.is_set()


async def test_a_stream_that_ends_by_itself_sends_no_shutdown_comment() -> None:
    async def frames():
        yield b"a"
        yield b"b"

    assert [f async for f in until_stopping(asyncio.Event(), frames())] == [b"a", b"b"]


async def test_a_blocking_wait_answers_the_fallback_once_stopping_and_is_cancelled() -> None:
    stopping = asyncio.Event()
    cancelled = asyncio.Event()

    async def wait_forever() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    waiter = asyncio.ensure_future(unless_stopping(stopping, wait_forever(), "fallback"))
    await asyncio.sleep(0)  # let it start waiting
    stopping.set()
    assert await waiter == "fallback"
    assert cancelled.is_set()


async def test_a_wait_that_finishes_first_returns_its_value() -> None:
    async def quick() -> str:
        return "done"

    assert await unless_stopping(asyncio.Event(), quick(), "fallback") == "done"


async def test_a_client_that_goes_away_mid_wait_closes_the_source_without_an_error() -> None:
    """The response task is cancelled while a frame is awaited (a client disconnect)."""
    closed = asyncio.Event()

    waiting = asyncio.Event()

    async def frames():
        try:
            yield b"one"
            waiting.set()  # the consumer took the first frame and asked for the second
            await asyncio.Event().wait()
            yield b"never"
        finally:
            closed.set()

    async def consume() -> None:
        async for _frame in until_stopping(asyncio.Event(), frames()):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(waiting.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed.is_set()
