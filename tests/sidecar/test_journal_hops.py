"""The journal's threading (journal.py "Threading"): one worker hop per method,
cancelled callers never leave half a transaction, nothing leaks from a failed open."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from kits.poll import until_async

from aip_crewai.sidecar.errors import JournalForeign, JournalFull
from aip_crewai.sidecar.jobs.model import EventRow, JobStatus, NewJob, TaskRunRef
from aip_crewai.sidecar.journal import files as journal_files
from aip_crewai.sidecar.journal import lock
from aip_crewai.sidecar.journal.store import Journal

pytestmark = pytest.mark.timeout(60)

BIG = 1 << 40
WORKER = "aip-sidecar-journal"


def new(action_id: str) -> NewJob:
    return NewJob(action_id, "echo", "run", f"hash-{action_id}", "key", None)


def ev(sequence: int, event: str = "chunk") -> EventRow:
    return EventRow(sequence, event, b'{"content":"x"}')


def workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(WORKER)}


def lock_is_free(path) -> bool:
    try:
        lock.release_lock(lock.acquire_lock(path))
    except Exception:
        return False
    return True


CALLS: dict[str, Callable[[Journal], Awaitable[Any]]] = {
    "admit a new job": lambda j: j.admit(new("n"), max_retained_runs=BIG, max_bytes=BIG),
    "admit a repeat": lambda j: j.admit(new("run"), max_retained_runs=BIG, max_bytes=BIG),
    "admit past the size bound": lambda j: j.admit(new("n"), max_retained_runs=BIG, max_bytes=1),
    "get": lambda j: j.get("run"),
    "summary": lambda j: j.summary("run"),
    "read_events": lambda j: j.read_events("run", 0, max_bytes=10),
    "summary_and_events": lambda j: j.summary_and_events("done", 0, limit=10),
    "find_task_run": lambda j: j.find_task_run("echo", "t1"),
    "list_jobs": lambda j: j.list_jobs(),
    "used_bytes": lambda j: j.used_bytes(),
    "recover": lambda j: j.recover(),
    "append_events": lambda j: j.append_events("run", 1, [ev(1), ev(2)]),
    "append_events (stale)": lambda j: j.append_events("run", 0, [ev(0)]),
    "transition": lambda j: j.transition(
        "run",
        JobStatus.COMPLETED,
        first_sequence=1,
        output=b"{}",
        events=[ev(1, "completed")],
        task_runs=[TaskRunRef("t2")],
    ),
    "set_provider_stop_observed": lambda j: j.set_provider_stop_observed("done", True),
    "archive": lambda j: j.archive("done"),
    "close": lambda j: j.close(),
}


@pytest.mark.parametrize("name", CALLS)
async def test_every_public_method_makes_exactly_one_worker_hop(tmp_path, name):
    j = await Journal.open(tmp_path / "j.db")
    try:
        for action_id in ("run", "done", "queued"):
            await j.admit(new(action_id), max_retained_runs=BIG, max_bytes=BIG)
        for action_id in ("run", "done"):
            await j.transition(action_id, JobStatus.RUNNING, first_sequence=0, events=[ev(0, "started")])
        await j.transition(
            "done",
            JobStatus.COMPLETED,
            first_sequence=1,
            events=[ev(1, "completed")],
            output=b'{"tasks_output":[]}',
            task_runs=[TaskRunRef("t1")],
        )
        hops = 0
        submit = j._worker.submit

        def counting(fn: Callable[..., Any], *args: Any) -> Any:
            nonlocal hops
            hops += 1
            return submit(fn, *args)

        j._worker.submit = counting
        try:
            await CALLS[name](j)
        except JournalFull:
            assert name == "admit past the size bound"
        assert hops == 1, f"{name} made {hops} hops"
    finally:
        await j.close()


async def test_summary_and_events_reads_a_page_only_inside_the_journal(tmp_path):
    """The replay's one-hop read: the summary always, the events only for ``0 <= cursor < event_count`` of
    a retained job, at most ``limit`` of them and never past ``event_count``."""
    j = await Journal.open(tmp_path / "j.db")
    try:
        await j.admit(new("done"), max_retained_runs=BIG, max_bytes=BIG)
        await j.transition("done", JobStatus.RUNNING, first_sequence=0, events=[ev(0, "started")])
        await j.transition(
            "done", JobStatus.COMPLETED, first_sequence=1, output=b"{}", events=[ev(1), ev(2), ev(3, "completed")]
        )
        summary = (JobStatus.COMPLETED, 4, False)
        assert await j.summary_and_events("nope", 0, limit=10) == (None, [])
        for cursor, limit, sequences in [
            (0, 10, [0, 1, 2, 3]),
            (1, 2, [1, 2]),
            (3, 10, [3]),
            (4, 10, []),
            (5, 10, []),
            (-1, 10, []),
            (0, 0, []),
        ]:
            got, events = await j.summary_and_events("done", cursor, limit=limit)
            assert got == summary and [e.sequence for e in events] == sequences, (cursor, limit)
        _, events = await j.summary_and_events("done", 0, limit=10, max_bytes=1)
        assert [e.sequence for e in events] == [0]  # the first event always, then the byte bound
        await j.archive("done")
        assert await j.summary_and_events("done", 0, limit=10) == ((JobStatus.COMPLETED, 4, True), [])
    finally:
        await j.close()


async def _cancel_mid_statement(j: Journal, statement: str, call: Awaitable[Any]) -> None:
    """Start ``call``, cancel it while the worker is blocked at ``statement``, then let the worker go on."""
    entered, gate = threading.Event(), threading.Event()

    def trace(sql: str) -> None:  # runs on the worker, inside the transaction
        if sql.startswith(statement):
            entered.set()
            gate.wait(10)

    await j._run(j._conn.set_trace_callback, trace)
    task = asyncio.ensure_future(call)
    assert await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await j._run(j._conn.set_trace_callback, None)  # queued behind the cancelled call: it has ended
    assert not await j._run(lambda: j._conn.in_transaction)


async def test_a_cancelled_admission_still_commits_whole(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        await _cancel_mid_statement(j, "INSERT INTO jobs", j.admit(new("a"), max_retained_runs=BIG, max_bytes=BIG))
        record = await j.get("a")
        assert record is not None and record.status is JobStatus.QUEUED and j.retained_runs == 1
        _record, created = await j.admit(new("b"), max_retained_runs=BIG, max_bytes=BIG)  # the journal still writes
        assert created and j.retained_runs == 2
    finally:
        await j.close()


async def test_a_cancelled_transition_applies_status_and_events_together(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        await j.admit(new("a"), max_retained_runs=BIG, max_bytes=BIG)
        await j.transition("a", JobStatus.RUNNING, first_sequence=0, events=[ev(0, "started")])
        events = [ev(1), ev(2), ev(3, "completed")]
        await _cancel_mid_statement(
            j,
            "INSERT INTO events",
            j.transition("a", JobStatus.COMPLETED, first_sequence=1, events=events, output=b"{}"),
        )
        record = await j.get("a")
        assert record is not None and record.status is JobStatus.COMPLETED and record.event_count == 4
        assert [e.sequence for e in await j.read_events("a", 0)] == [0, 1, 2, 3]
    finally:
        await j.close()


async def test_close_stops_the_worker_and_releases_the_lock(tmp_path):
    path = tmp_path / "j.db"
    before = workers()
    j = await Journal.open(path)
    assert len(workers() - before) == 1 and not lock_is_free(path)
    await j.close()
    await j.close()  # idempotent
    assert workers() == before and lock_is_free(path)


async def test_a_refused_open_leaks_neither_the_worker_nor_the_lock(tmp_path):
    path = tmp_path / "j.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (body TEXT)")
    db.close()
    path.chmod(0o600)
    before = workers()
    with pytest.raises(JournalForeign):
        await Journal.open(path)
    assert lock_is_free(path)
    await until_async(lambda: workers() == before, interval=0.01, what="the worker threads gone")


async def test_a_cancelled_open_closes_its_connection_then_releases_the_lock(tmp_path, monkeypatch):
    path = tmp_path / "j.db"
    entered, gate = threading.Event(), threading.Event()
    check = journal_files._check_integrity

    def slow_check(conn: sqlite3.Connection, p: Any) -> None:
        entered.set()
        gate.wait(10)
        check(conn, p)

    monkeypatch.setattr(journal_files, "_check_integrity", slow_check)
    before = workers()
    task = asyncio.ensure_future(Journal.open(path))
    assert await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not lock_is_free(path)  # the worker still holds a connection: the lock stays held
    gate.set()
    await until_async(
        lambda: workers() == before and lock_is_free(path), interval=0.01, what="the worker threads gone, the lock free"
    )
    await (await Journal.open(path)).close()
