"""The live registry's change signal: a follower that read the store cannot miss a change before it waits."""

import asyncio

from aip_crewai.host.actions.live import LiveAction


async def test_a_change_between_the_read_and_the_wait_is_not_missed():
    """Regression: the follower took the event at wait time, so a notify between its store read and its
    wait was lost and chunks reached the tenant up to 15 s late. Now it waits for a change after the
    version it read before the store."""
    live = LiveAction(job=None)
    seen = live.version
    live.notify()  # the dispatch stored a chunk after the follower's read
    assert await asyncio.wait_for(live.wait(15.0, seen=seen), 1.0) is True


async def test_without_a_change_the_wait_times_out_and_a_later_change_wakes_it():
    live = LiveAction(job=None)
    assert await live.wait(0.01, seen=live.version) is False
    waiter = asyncio.ensure_future(live.wait(15.0, seen=live.version))
    await asyncio.sleep(0)
    live.notify()
    assert await asyncio.wait_for(waiter, 1.0) is True
