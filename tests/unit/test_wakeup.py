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
