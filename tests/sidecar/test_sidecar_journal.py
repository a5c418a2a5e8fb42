"""The SQLite job journal (ARCHITECTURE.md §5): schema, transitions, crash fence, fences, bounds."""

from __future__ import annotations

import errno
import json
import os
import sqlite3

import msgspec
import pytest

from aip_crewai.sidecar.errors import (
    JournalError,
    JournalFull,
    JournalInsecure,
    JournalLocked,
    JournalSchemaError,
    JournalWriteFailed,
)
from aip_crewai.sidecar.jobs.model import TRANSITIONS, ArchiveOutcome, EventRow, JobStatus, NewJob, TaskRunRef
from aip_crewai.sidecar.journal import files as journal_files
from aip_crewai.sidecar.journal.crash_fence import RESTARTED_QUEUED, RESTARTED_RUNNING
from aip_crewai.sidecar.journal.store import SCHEMA_VERSION, Journal

pytestmark = pytest.mark.timeout(60)

BIG = 1 << 40


def new(action_id: str, crew: str = "echo", operation: str = "run") -> NewJob:
    return NewJob(action_id, crew, operation, f"hash-{action_id}", "key", None)


def ev(sequence: int, event: str = "chunk", **data) -> EventRow:
    return EventRow(sequence, event, msgspec.json.encode(data or {"content": str(sequence)}))


async def started(j: Journal, action_id: str, crew: str = "echo", operation: str = "run") -> None:
    await j.admit(new(action_id, crew, operation), max_retained_runs=BIG, max_bytes=BIG)
    assert await j.transition(action_id, JobStatus.RUNNING, first_sequence=0, events=[ev(0, "started")])


def schema(path) -> list[tuple]:
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        version = db.execute("PRAGMA user_version").fetchone()[0]
    return [*rows, ("user_version", version)]


async def test_fresh_journal_equals_all_migrations_applied_in_order(tmp_path):
    fresh = tmp_path / "fresh.db"
    await (await Journal.open(fresh)).close()
    stepwise = tmp_path / "stepwise.db"
    for number in range(1, SCHEMA_VERSION + 1):
        # a database left at version `number - 1`, then opened by code that knows `number` migrations
        original = journal_files.SCHEMA_VERSION
        journal_files.SCHEMA_VERSION = number
        try:
            await (await Journal.open(stepwise)).close()
        finally:
            journal_files.SCHEMA_VERSION = original
        assert schema(stepwise)[-1] == ("user_version", number)
    assert schema(fresh) == schema(stepwise)
    assert schema(fresh)[-1] == ("user_version", SCHEMA_VERSION) and SCHEMA_VERSION == len(journal_files.MIGRATIONS)


async def test_journal_uses_wal_and_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "j.db"
    await (await Journal.open(path)).close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(JournalSchemaError, match="schema version"):
        await Journal.open(path)


async def test_journal_file_is_created_0600_and_wider_modes_are_refused(tmp_path):
    path = tmp_path / "j.db"
    await (await Journal.open(path)).close()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(f"{path}.lock").st_mode & 0o777 == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(JournalInsecure, match="must be 0600"):
        await Journal.open(path)


async def test_open_refuses_unsafe_directories_and_symlinks(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(JournalInsecure, match="group- or world-writable"):
        await Journal.open(shared / "j.db")
    with pytest.raises(JournalInsecure, match="does not exist"):
        await Journal.open(tmp_path / "missing" / "j.db")
    target = tmp_path / "real.db"
    await (await Journal.open(target)).close()
    (tmp_path / "link.db").symlink_to(target)
    with pytest.raises(JournalInsecure, match="symlink"):
        await Journal.open(tmp_path / "link.db")


async def test_a_second_owner_is_refused_until_the_first_closes(tmp_path):
    path = tmp_path / "j.db"
    first = await Journal.open(path)
    with pytest.raises(JournalLocked, match="already owned by another active sidecar"):
        await Journal.open(path)
    await first.close()
    await (await Journal.open(path)).close()


def read_only_for(monkeypatch, refuse) -> None:
    """Make ``os.open`` fail as on a read-only file system for the paths ``refuse(path, flags)`` picks."""
    real_open = os.open

    def fake(path, flags, *args, **kwargs):
        if refuse(str(path), flags):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake)


async def test_a_lock_file_that_cannot_be_created_is_a_journal_error_naming_it(tmp_path, monkeypatch):
    """Regression: a journal on a read-only file system raised a bare OSError from ``acquire_lock``
    (a traceback, exit 1); it is a JournalError naming the lock file and the reason (one line, exit 2)."""
    read_only_for(monkeypatch, lambda path, flags: path.endswith(".lock"))
    with pytest.raises(JournalError, match=r"cannot open the lock file .*j\.db\.lock: Read-only file system"):
        await Journal.open(tmp_path / "j.db")


async def test_a_journal_file_that_cannot_be_created_is_a_journal_error_naming_it(tmp_path, monkeypatch):
    """The lock taken (its file already there), the journal file itself cannot be created: a JournalError
    naming it, the lock released (a second open meets the same refusal, not "already owned")."""
    path = tmp_path / "j.db"
    await (await Journal.open(path)).close()
    path.unlink()
    read_only_for(monkeypatch, lambda name, flags: name == str(path) and bool(flags & os.O_EXCL))
    for _ in range(2):
        with pytest.raises(JournalError, match=r"cannot create .*j\.db: Read-only file system"):
            await Journal.open(path)


async def test_transitions_follow_the_table_and_stale_writers_change_nothing(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        await j.admit(new("a"), max_retained_runs=BIG, max_bytes=BIG)
        assert not await j.transition("a", JobStatus.COMPLETED, first_sequence=0, events=[ev(0, "completed")])
        assert await j.transition("a", JobStatus.RUNNING, first_sequence=0, events=[ev(0, "started")])
        assert not await j.transition("a", JobStatus.RUNNING, first_sequence=1, events=[ev(1, "started")])
        assert not await j.append_events("a", 0, [ev(0)])  # stale sequence
        assert await j.append_events("a", 1, [ev(1), ev(2)])
        assert not await j.transition("a", JobStatus.COMPLETED, first_sequence=2, events=[ev(2, "completed")])
        assert await j.transition("a", JobStatus.CANCELLED, first_sequence=3, events=[ev(3, "cancelled")])
        for target in JobStatus:
            assert not await j.transition("a", target, first_sequence=4, events=[ev(4, target.value)])
        assert not await j.append_events("a", 4, [ev(4)])
        record = await j.get("a")
        assert record.status is JobStatus.CANCELLED and record.event_count == 4
        assert [r.event for r in await j.read_events("a", 0)] == ["started", "chunk", "chunk", "cancelled"]
    finally:
        await j.close()
    assert all(not TRANSITIONS[s] for s in JobStatus if s.terminal)


async def test_recovery_fails_unfinished_jobs_once_and_never_touches_terminal_ones(tmp_path):
    path = tmp_path / "j.db"
    j = await Journal.open(path)
    await started(j, "running", operation="run")
    await j.append_events("running", 1, [ev(1)])
    await j.admit(new("queued"), max_retained_runs=BIG, max_bytes=BIG)
    await started(j, "done")
    await j.transition("done", JobStatus.COMPLETED, first_sequence=1, events=[ev(1, "completed")], output=b"{}")
    await j.close()  # as if the process died here

    j = await Journal.open(path)
    try:
        recovered = dict(await j.recover())
        assert recovered == {"running": JobStatus.RUNNING, "queued": JobStatus.QUEUED}
        assert await j.recover() == []
        running = await j.read_events("running", 0)
        assert [r.event for r in running] == ["started", "chunk", "failed"] and running[-1].sequence == 2
        assert json.loads(running[-1].data) == {
            "status": "failed",
            "error_type": "SidecarRestarted",
            "message": RESTARTED_RUNNING,
            "uncertain_outcome": True,
        }
        queued = await j.read_events("queued", 0)
        assert json.loads(queued[0].data)["message"] == RESTARTED_QUEUED
        assert json.loads(queued[0].data)["uncertain_outcome"] is False
        assert (await j.get("done")).status is JobStatus.COMPLETED
        assert (await j.get("running")).status is JobStatus.FAILED
    finally:
        await j.close()


async def test_retained_limit_and_size_bound_refuse_admission_but_repeats_pass(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        await j.admit(new("a"), max_retained_runs=1, max_bytes=BIG)
        with pytest.raises(JournalFull, match="retained"):
            await j.admit(new("b"), max_retained_runs=1, max_bytes=BIG)
        record, created = await j.admit(new("a"), max_retained_runs=1, max_bytes=BIG)
        assert not created and record.action_id == "a"
        with pytest.raises(JournalFull, match="size bound"):
            await j.admit(new("c"), max_retained_runs=10, max_bytes=1)
        assert await j.get("b") is None and await j.get("c") is None and j.retained_runs == 1
    finally:
        await j.close()


async def test_a_failed_admission_write_is_rolled_back(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        await j._run(
            j._conn.execute, "CREATE TEMP TRIGGER boom AFTER INSERT ON jobs BEGIN SELECT RAISE(FAIL, 'io'); END"
        )
        with pytest.raises(JournalWriteFailed):
            await j.admit(new("a"), max_retained_runs=BIG, max_bytes=BIG)
        await j._run(j._conn.execute, "DROP TRIGGER boom")
        assert await j.get("a") is None and j.retained_runs == 0
        _record, created = await j.admit(new("a"), max_retained_runs=BIG, max_bytes=BIG)
        assert created
    finally:
        await j.close()


async def test_task_index_finds_retained_completed_runs_of_the_same_crew_only(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        run_output = {"raw": "r", "tasks_output": [{"task_id": "t1"}]}
        batch_output = {
            "results": [{"tasks_output": [{"task_id": "b0"}]}, {"tasks_output": [{"task_id": "b1"}]}],
            "count": 2,
        }
        for aid, op, out, refs in (
            ("r", "run", run_output, [TaskRunRef("t1")]),
            ("b", "batch_run", batch_output, [TaskRunRef("b0", 0), TaskRunRef("b1", 1)]),
        ):
            await started(j, aid, operation=op)
            raw = msgspec.json.encode(out)
            assert await j.transition(
                aid,
                JobStatus.COMPLETED,
                first_sequence=1,
                events=[EventRow(1, "completed", raw)],
                output=raw,
                task_runs=refs,
            )
        assert json.loads(await j.find_task_run("echo", "t1")) == run_output
        assert json.loads(await j.find_task_run("echo", "b1")) == batch_output["results"][1]
        assert await j.find_task_run("other", "t1") is None
        assert await j.find_task_run("echo", "nope") is None
        assert await j.archive("r") is ArchiveOutcome.ARCHIVED
        assert await j.find_task_run("echo", "t1") is None
    finally:
        await j.close()


async def test_archive_keeps_a_tombstone_and_deletes_events_and_output(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        await started(j, "a")
        assert await j.archive("a") is ArchiveOutcome.NOT_TERMINAL
        await j.transition("a", JobStatus.COMPLETED, first_sequence=1, events=[ev(1, "completed")], output=b"{}")
        assert j.retained_runs == 1
        assert await j.archive("a") is ArchiveOutcome.ARCHIVED
        assert await j.archive("a") is ArchiveOutcome.ALREADY_ARCHIVED
        assert await j.archive("zzz") is ArchiveOutcome.NOT_FOUND
        record = await j.get("a")
        assert record.archived and record.output is None and record.request_hash == "hash-a"
        assert await j.read_events("a", 0) == [] and j.retained_runs == 0
    finally:
        await j.close()


async def _vm_steps_to_append(j: Journal, action_id: str, sequence: int) -> tuple[int, int]:
    """SQLite virtual-machine steps and statements of one checkpoint append."""
    steps = statements = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0

    def trace(_sql: str) -> None:
        nonlocal statements
        statements += 1

    await j._run(j._conn.set_progress_handler, step, 1)
    await j._run(j._conn.set_trace_callback, trace)
    assert await j.append_events(action_id, sequence, [ev(sequence)])
    await j._run(j._conn.set_progress_handler, None, 1)
    await j._run(j._conn.set_trace_callback, None)
    return steps, statements


async def test_append_cost_does_not_depend_on_retained_jobs(tmp_path):
    """An append is indexed: the same VM operation count with 10 or 10,000 retained jobs."""
    costs = []
    for retained in (10, 10_000):
        path = tmp_path / f"j{retained}.db"
        j = await Journal.open(path)
        try:

            def fill() -> None:  # on the journal's worker, the thread owning the connection
                j._conn.executemany(
                    "INSERT INTO jobs (action_id, crew_id, operation, request_hash, idempotency_key, status, "
                    "event_count, created_at, updated_at) VALUES (?, 'echo', 'run', 'h', 'k', 'completed', 3, 0, 0)",
                    [(f"old-{i}",) for i in range(retained)],
                )
                j._conn.executemany(
                    "INSERT INTO events VALUES (?, ?, 'chunk', '{}')",
                    [(f"old-{i}", s) for i in range(retained) for s in range(3)],
                )

            await j._run(j._write_now, fill)
            await started(j, "live")
            await _vm_steps_to_append(j, "live", 1)  # warm the statement cache
            costs.append(await _vm_steps_to_append(j, "live", 2))
        finally:
            await j.close()
    assert costs[0] == costs[1], costs
    assert costs[0][0] > 10 and costs[0][1] >= 3  # the probe measured real work


async def test_the_wal_file_shrinks_back_to_its_limit_after_a_large_commit(tmp_path):
    path = tmp_path / "journal.db"
    j = await Journal.open(path)
    try:
        await started(j, "big")
        spike = [EventRow(n, "chunk", msgspec.json.encode("x" * 100_000)) for n in range(1, 121)]
        assert await j.append_events("big", 1, spike)  # one commit of about 12 MiB
        assert journal_files.wal_bytes(path) > 2 * journal_files.WAL_SIZE_LIMIT_BYTES
        # the next commits checkpoint and restart the WAL, which is then truncated to its limit
        for n in range(121, 124):
            assert await j.append_events("big", n, [ev(n)])
        assert journal_files.wal_bytes(path) <= journal_files.WAL_SIZE_LIMIT_BYTES
    finally:
        await j.close()
    assert journal_files.wal_bytes(path) == 0


async def test_the_size_bound_counts_the_wal_file(tmp_path):
    path = tmp_path / "journal.db"
    j = await Journal.open(path)
    try:
        await started(j, "a")
        assert await j.append_events("a", 1, [EventRow(1, "chunk", msgspec.json.encode("y" * 200_000))])
        wal = journal_files.wal_bytes(path)
        pages = await j._run(lambda: j._used_bytes_now() - journal_files.wal_bytes(path))
        assert wal > 200_000
        # above the used pages alone, below pages + WAL: full
        with pytest.raises(JournalFull):
            await j.admit(new("b"), max_retained_runs=BIG, max_bytes=pages + wal)
        record, created = await j.admit(new("c"), max_retained_runs=BIG, max_bytes=pages + wal + 1)
        assert created and record.action_id == "c"
    finally:
        await j.close()
