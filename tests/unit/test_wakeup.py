"""The shared wake-up primitive: a follower that registered before reading never misses a change."""

import asyncio

from aip_crewai.plumbing.wakeup import ChangeSignal


async def test_an_event_taken_before_the_read_is_set_by_a_later_change():
    signal = ChangeSignal()
    taken = signal.changed()  # register interest, then read the state...
    signal.notify()  # ...a change lands before the follower waits
    assert taken.is_set() and not signal.changed().is_set()


async def test_a_version_seen_before_the_read_makes_the_wait_return_at_once():
    signal = ChangeSignal()
    seen = signal.version
    signal.notify()
    assert await asyncio.wait_for(signal.wait(15.0, seen=seen), 1.0) is True
    assert await signal.wait(0.01, seen=signal.version) is False


async def test_cancel_all_ends_a_task_that_swallowed_its_first_cancellation():
    """Before Python 3.12 ``asyncio.wait_for`` may swallow a cancellation (a loop around it runs on): a
    shutdown cancels again until every task has ended, and never raises what the tasks raised."""
    from aip_crewai.plumbing.wakeup import cancel_all

    swallowed = 0
    started = asyncio.Event()

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                started.set()
                await asyncio.Event().wait()  # blocked until cancelled
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise

    async def failing() -> None:
        raise RuntimeError("ended badly")

    tasks = [asyncio.create_task(stubborn()), asyncio.create_task(failing())]
    await started.wait()
    await cancel_all(tasks)
    assert tasks[0].cancelled() and swallowed == 2
    assert isinstance(tasks[1].exception(), RuntimeError)
