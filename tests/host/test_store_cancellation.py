"""A store call cancelled just as it completes ends cancelled, on both engines (docs/operating.md "Faults and
their bounds"): the call bound must not swallow the cancellation. Python 3.11's ``asyncio.wait_for`` did, on
PostgreSQL (the engine with a bound); the webhook sender polling the store then never stopped, and a test
waiting for it ran into pytest-timeout."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kits.poll import until_async

from aip_crewai.host.store.store import Store


@pytest.fixture(params=["sqlite", "postgresql"])
async def bounded_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """A store with a call bound and ONE worker thread, so a no-op submitted after a call runs after it."""
    if request.param == "sqlite":
        tmp_path.chmod(0o700)
        store = await Store.open(tmp_path / "host.db")
        store._db.call_timeout_s = 60.0  # SQLite has no bound of its own: give it PostgreSQL's path
    else:
        store = await Store.open(request.getfixturevalue("postgres_url"), pool_size=1)
    try:
        yield store
    finally:
        await store.close()


async def test_a_cancellation_arriving_as_a_store_call_completes_is_not_lost(bounded_store: Store):
    """The cancellation lands 0 to 5 loop turns after the call's thread has returned: whichever turn
    completes the call's future (one with the bare hop, more with a ``wait_for`` task around it), a task
    that was still waiting when cancelled ends cancelled."""
    cancelled = 0
    for turns in range(6):
        entered, go = threading.Event(), threading.Event()

        def held() -> int:
            entered.set()
            go.wait(30)
            return 1

        task = asyncio.create_task(bounded_store._run(held))
        await until_async(entered.is_set, what="the call on the store's worker thread")
        go.set()
        bounded_store._worker.submit(lambda: None).result()  # the call has returned; its answer is queued
        for _ in range(turns):
            await asyncio.sleep(0)  # one loop turn: the answer moves one step towards the task
        if task.done():  # answered before the cancellation: nothing to lose
            continue
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled += 1
    assert cancelled >= 2  # the race was run, not skipped
    assert await bounded_store.get_action("acme", "act-none") is None  # the store still serves
