"""The SQLite job journal: the sidecar's durable state, and (with :mod:`.files`, :mod:`.queries`,
:mod:`.crash_fence` and :mod:`.retention`) its only SQL.

One file, owned by one process: an exclusive ``flock`` on ``<journal>.lock``
refuses a second sidecar. WAL mode with ``synchronous=FULL``: every commit is
durable when it returns. Forward-only numbered migrations tracked with
``PRAGMA user_version``. Every write is one ``BEGIN IMMEDIATE`` transaction.

Threading: the ``sqlite3`` connection lives on one dedicated worker thread and
every journal method runs ALL its statements there as one function, ``BEGIN
IMMEDIATE`` .. ``COMMIT``/``ROLLBACK`` included (one thread hop per method,
not one per statement and cursor call as with aiosqlite, whose hops cost
about 85 µs each on the benchmark machine; ``admit`` made about 8). Calls are
thereby serialized, so a multi-statement transaction never interleaves with
another coroutine's statements, and a cancelled caller never leaves a
transaction half done: the function runs to its end on the worker.

Rows (JSON columns are compact UTF-8 JSON bytes):

- ``jobs``: one row per admitted action id; ``status`` moves along
  :data:`TRANSITIONS` only, enforced by the ``WHERE`` clause of every update
  (with the expected ``event_count``, so a stale writer changes nothing).
  ``output`` is the operation output (completed jobs), ``error`` the failed
  event data. Archived rows are tombstones: output, events and task index
  rows are deleted, the request hash stays so the action id never runs again.
- ``events``: ``(action_id, sequence)`` primary key; appends are indexed
  inserts plus one primary-key update of the job row, whatever the number of
  retained jobs.
- ``task_runs``: task id -> the completed run/replay/batch_run holding it
  (``result_index`` for batch items), for ``replay`` admission.

Opening the file (worker start-up, identity and integrity checks,
migrations) lives in :mod:`.files`; the schema in :mod:`.schema`; retention (the admission bounds,
archiving, imported jobs) in :mod:`.retention`.

Source: ARCHITECTURE.md §5 (journal, durability, crash fence), ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import structlog

from aip_crewai.plumbing.storage import hop
from aip_crewai.sidecar.errors import JournalError, JournalWriteFailed
from aip_crewai.sidecar.jobs.model import (
    ArchiveOutcome,
    EventRow,
    ImportedJob,
    JobRecord,
    JobStatus,
    NewJob,
    RunState,
    TaskRunRef,
    sources_of,
)
from aip_crewai.sidecar.journal import lock
from aip_crewai.sidecar.journal.crash_fence import UNFINISHED_JOBS, end_unfinished
from aip_crewai.sidecar.journal.ended import MAX_ENTRIES, EndedJobs
from aip_crewai.sidecar.journal.files import (
    SCHEMA_VERSION,
    check_main_file,
    fetch_rows,
    fetch_scalar,
    file_identity,
    release,
    start_journal_worker,
    wal_bytes,
)
from aip_crewai.sidecar.journal.queries import (
    GET_JOB,
    INSERT_EVENTS,
    INSERT_TASK_RUNS,
    JOB_COLUMNS,
    JOBS_ENDING,
    TASK_RUN_HIT,
    job_record,
    read_events,
    read_summary,
    read_summary_and_events,
    task_run_hit,
)
from aip_crewai.sidecar.journal.retention import check_room, insert_imported, tombstone
from aip_crewai.sidecar.tenancy import tenant_of

__all__ = ["Journal", "SCHEMA_VERSION"]

log = structlog.get_logger(__name__)


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Stale(Exception):
    """Internal: the guarded update matched no row; roll back quietly."""


_T = TypeVar("_T")


# ------------------------------------------------------------------- journal


class Journal:
    """Async access to one journal file. Create with :meth:`open`; one per process."""

    def __init__(
        self,
        path: Path,
        conn: sqlite3.Connection,
        worker: ThreadPoolExecutor,
        lock_fd: int | None,
        page_size: int,
        retained: int,
    ) -> None:
        self.path = path
        self._conn = conn
        self._worker = worker
        self._lock_fd = lock_fd  # None when read-only
        self._page_size = page_size
        self._retained = retained  # changed on the worker only
        self._closed = False
        self._identity = file_identity(path)
        self._ended = EndedJobs(max_entries=0 if lock_fd is None else MAX_ENTRIES)  # read-only: others write

    # ------------------------------------------------------------ lifecycle

    @classmethod
    async def open(cls, path: Path) -> Journal:
        """Fence, check, open and migrate the journal at ``path``.

        Order: the parent directory must exist and not be group/world-writable;
        ``<path>.lock`` is locked exclusively (non-blocking); the journal (and
        its ``-wal``/``-shm`` files) must be regular non-symlink files without
        group/other permission bits, and is created with mode 0600 when absent;
        then, reading only, SQLite's ``quick_check`` (a damaged file is refused
        before the crash fence writes to it) and the identity check
        (:func:`.files._check_identity`: another application's
        database is never touched); then WAL, ``synchronous=FULL`` and
        migrations. The worker thread and the lock never outlive a failed (or
        cancelled) open.

        Raises:
            JournalLocked: another process holds the lock ("already owned by
                another active sidecar").
            JournalInsecure: a permission or file-type rule is broken.
            JournalForeign: the file is not SQLite, or another application's database.
            JournalCorrupt: the integrity check failed.
            JournalSchemaError: the file's schema is newer than this code.
            JournalError: SQLite cannot open the file.

        Source: ARCHITECTURE.md §5 (Journal).
        """
        path = Path(path).absolute()
        lock.check_parent(path.parent)
        lock_path = Path(f"{path}.lock")
        lock_is_new = not os.path.lexists(lock_path)
        lock_fd = lock.acquire_lock(path)
        try:
            for candidate in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                lock.check_private_file(candidate)
            check_main_file(path)
            lock.create_private_file(path)
        except BaseException:
            if lock_is_new:  # a refused file gets no lock file beside it (e.g. a reference runs.json)
                lock_path.unlink(missing_ok=True)
            lock.release_lock(lock_fd)
            raise
        worker, (conn, page_size, retained) = await start_journal_worker(path, lock_fd, readonly=False)
        return cls(path, conn, worker, lock_fd, page_size, retained)

    @classmethod
    async def open_readonly(cls, path: Path) -> Journal:
        """Open a journal file read-only for inspection (``aip-crewai journal``):
        no lock, no migration, no writes; safe while a sidecar owns the file.

        Raises:
            JournalError: not a readable SQLite journal of this project.
            JournalSchemaError: the schema is newer than this code.
        """
        path = Path(path).absolute()
        if not path.is_file():
            raise JournalError(f"no journal file at {path}")
        worker, (conn, page_size, retained) = await start_journal_worker(path, None, readonly=True)
        return cls(path, conn, worker, None, page_size, retained)

    def still_at_path(self) -> bool:
        """Whether ``self.path`` still names the file this journal opened.

        A rename or copy onto the path (another file put in the journal's
        place while the sidecar runs) is seen by the device and inode number:
        the open connection keeps writing the old file, so nothing recorded
        from then on would be found at the path by the next start.

        Returns:
            False when the path is missing or is another file. One ``stat``.

        Source: docs/security.md ("Tenant-scoped crew state": journal identity).
        """
        return self._identity is not None and file_identity(self.path) == self._identity

    async def list_jobs(self, limit: int = 50) -> list[JobRecord]:
        """The newest ``limit`` jobs (archived tombstones included), newest first."""
        rows = await self._fetch(
            f"SELECT {JOB_COLUMNS} FROM jobs ORDER BY created_at DESC, action_id LIMIT ?", (limit,)
        )
        return [job_record(row) for row in rows]

    async def close(self) -> None:
        """Close the connection (on the worker), stop the worker and release the lock (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._run(self._checkpoint_and_close)
        finally:
            self._worker.shutdown(wait=True)
            release(self._lock_fd)
            self._lock_fd = None

    def _checkpoint_and_close(self) -> None:
        """Copy the WAL into the main file and truncate it, then close (a failed checkpoint is harmless).

        A read-only journal (``open_readonly``, beside the owning process) only closes."""
        if self._lock_fd is not None:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                log.warning("journal_checkpoint_failed", error_type=type(exc).__name__)
        self._conn.close()

    @property
    def retained_runs(self) -> int:
        """Non-archived jobs (kept in memory: one process owns the file)."""
        return self._retained

    async def used_bytes(self) -> int:
        """Bytes of pages in use (file size minus free pages)."""
        return await self._run(self._used_bytes_now)

    # ------------------------------------------------------------ the worker

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the journal's worker thread (the only thread using the connection).

        Logs ``journal_write_failed`` here, in the caller's context (request id).
        """
        try:
            return await hop(self._worker, fn, *args)
        except JournalWriteFailed as exc:
            log.error("journal_write_failed", error_type=type(exc.__cause__).__name__)
            raise

    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return await self._run(fetch_rows, self._conn, sql, params)

    def _write_now(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` (on the worker) in one ``BEGIN IMMEDIATE`` .. ``COMMIT``;
        rolled back on any exception.

        Raises JournalWriteFailed for SQLite errors; :class:`_Stale` passes through.
        """
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            result = fn(*args)
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    log.error("journal_rollback_failed")
            if isinstance(exc, sqlite3.Error):
                raise JournalWriteFailed() from exc
            raise
        return result

    def _guarded_now(self, action_id: str, fn: Callable[[], None]) -> bool:
        """:meth:`_write_now` of a guarded update of job ``action_id`` (its row kept in memory dropped first):
        False (rolled back) when ``fn`` raises :class:`_Stale`."""
        self._ended.forget(action_id)
        try:
            self._write_now(fn)
        except _Stale:
            return False
        return True

    def _update_one(self, sql: str, params: Sequence[Any]) -> None:
        """Run a guarded ``UPDATE`` (on the worker); raise :class:`_Stale` unless it changed one row."""
        if self._conn.execute(sql, params).rowcount != 1:
            raise _Stale

    def _used_bytes_now(self) -> int:
        """Bytes the journal holds on disk for the size bound: used pages plus the ``-wal`` file."""
        pages = fetch_scalar(self._conn, "PRAGMA page_count") or 0
        free = fetch_scalar(self._conn, "PRAGMA freelist_count") or 0
        return int((pages - free) * self._page_size) + wal_bytes(self.path)

    # ------------------------------------------------------------ crash fence

    async def recover(self) -> list[tuple[str, JobStatus]]:
        """Fail every job left ``queued`` or ``running`` by a previous process.

        Each gets a terminal ``failed`` event ``{status, error_type:
        "SidecarRestarted", message, uncertain_outcome}``: uncertain (True)
        for running jobs, certain (False) for queued ones, which never reached
        CrewAI. Nothing is ever re-run. One transaction (:func:`.crash_fence.end_unfinished`).

        Returns:
            ``[(action_id, previous status)]``.

        Source: ARCHITECTURE.md §5 (Crash fence).
        """

        def recover_now() -> list[tuple[str, JobStatus]]:
            found = fetch_rows(self._conn, UNFINISHED_JOBS)
            return self._write_now(end_unfinished, self._conn, found, _now_ms()) if found else []

        return await self._run(recover_now)

    # -------------------------------------------------------------- reads

    async def get(self, action_id: str) -> JobRecord | None:
        """The job row of ``action_id`` (archived tombstones included), or None; an ended job's row read
        before comes from memory, without the worker hop (:mod:`.ended`)."""
        return self._ended.get(action_id) or await self._run(self._get_now, action_id)

    def _get_now(self, action_id: str) -> JobRecord | None:
        rows = fetch_rows(self._conn, GET_JOB, (action_id,))
        return self._ended.remember(job_record(rows[0])) if rows else None

    async def job_ids_ending(self, action_id: str, limit: int = 10) -> list[str]:
        """Job ids ``<tenant>:<action_id>`` of any tenant (a full scan: for the operator's CLI, not a route).

        Returns:
            At most ``limit`` ids, sorted.

        Source: docs/reference/cli.md "Command line" (``journal inspect`` without the tenant prefix).
        """
        suffix = f":{action_id}"
        rows = await self._fetch(JOBS_ENDING, (len(suffix), len(suffix), suffix, limit))
        return [row[0] for row in rows]

    async def summary(self, action_id: str) -> tuple[JobStatus, int, bool] | None:
        """``(status, event_count, archived)`` without the output/error blobs, or None."""
        return await self._run(read_summary, self._conn, action_id)

    async def read_events(
        self, action_id: str, cursor: int, *, limit: int = 1000, max_bytes: int | None = None
    ) -> list[EventRow]:
        """Committed events of ``action_id`` with ``sequence >= cursor``, in order.

        Args:
            limit: at most this many events.
            max_bytes: stop before the data bytes would exceed this (the
                first event is always returned).
        """
        return await self._run(read_events, self._conn, action_id, cursor, limit, max_bytes)

    async def summary_and_events(
        self, action_id: str, cursor: int, *, limit: int, max_bytes: int | None = None
    ) -> tuple[tuple[JobStatus, int, bool] | None, list[EventRow]]:
        """:meth:`summary` and then, when ``0 <= cursor < event_count`` and the job is not archived,
        :meth:`read_events` of at most ``min(limit, event_count - cursor)`` events, in one hop to the
        journal's thread (a replay's page costs one hop, not two); ``(summary, [])`` otherwise."""
        return await self._run(read_summary_and_events, self._conn, action_id, cursor, limit, max_bytes)

    async def find_task_run(self, crew_id: str, task_id: str, tenant: str = "") -> bytes | None:
        """:meth:`find_task_run_hit` without the job id and result index."""
        hit = await self.find_task_run_hit(crew_id, task_id, tenant)
        return None if hit is None else hit[0]

    async def find_task_run_hit(
        self, crew_id: str, task_id: str, tenant: str = ""
    ) -> tuple[bytes, str, int | None] | None:
        """Output (JSON bytes of one serialized CrewOutput) of the latest retained
        completed job of ``(tenant, crew_id)`` whose ``tasks_output`` holds ``task_id``.

        For a batch_run the matching item of ``results`` is returned. None
        when no such run exists (other crews' and other tenants' runs never
        match; ``tenant`` is :func:`tenancy.tenant_of` of the job ids). When
        the run's :class:`RunState` was recorded, its keys (``fingerprint``)
        are added to the returned object.

        Returns:
            ``(output JSON bytes, job id, result index or None)``, or None.
        """
        rows = await self._fetch(TASK_RUN_HIT, (task_id, tenant, crew_id))
        return task_run_hit(rows)

    # -------------------------------------------------------------- writes

    async def admit(
        self, job: NewJob, *, max_retained_runs: int, max_bytes: int, started: EventRow | None = None
    ) -> tuple[JobRecord, bool]:
        """Insert a ``queued`` job row, or return the existing row of its action id. With ``started`` (the
        job's event 0, when a concurrency slot is free for it) the row is inserted ``running`` with that
        event, in the same transaction: the start of :meth:`transition` without a second commit.

        Returns:
            ``(record, created)``; ``created`` is False when the action id
            already existed (the caller compares request hashes).

        Raises:
            JournalFull: retained-run limit or size bound reached (nothing written).
            JournalWriteFailed: the insert failed (rolled back: nothing half-admitted).

        Source: ARCHITECTURE.md §4 (admission), §5 (durability).
        """

        def insert(now: int) -> JobRecord:
            self._conn.execute(
                "INSERT INTO jobs (action_id, crew_id, operation, request_hash, idempotency_key, timeout_ms, status, "
                "event_count, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.action_id,
                    job.crew_id,
                    job.operation,
                    job.request_hash,
                    job.idempotency_key,
                    job.timeout_ms,
                    "queued" if started is None else "running",
                    0 if started is None else 1,
                    now,
                    now,
                ),
            )
            if started is not None:
                self._conn.execute(INSERT_EVENTS, (job.action_id, started.sequence, started.event, started.data))
            return job_record(fetch_rows(self._conn, GET_JOB, (job.action_id,))[0])

        def admit_now() -> tuple[JobRecord, bool]:
            # Calls are serialized on the worker: no other admission can slip in between the read and the insert.
            existing = fetch_rows(self._conn, GET_JOB, (job.action_id,))
            if existing:
                return job_record(existing[0]), False
            check_room(self._retained, max_retained_runs, self._used_bytes_now, max_bytes)
            record = self._write_now(insert, _now_ms())
            self._retained += 1
            return record, True

        return await self._run(admit_now)

    async def append_events(self, action_id: str, first_sequence: int, events: Sequence[EventRow]) -> bool:
        """Commit a checkpoint of non-terminal events of a ``running`` job.

        Cost: one primary-key update and one indexed insert per event,
        independent of how many jobs the journal retains.

        Returns:
            False (nothing written) when the job is not running or its
            ``event_count`` is not ``first_sequence`` (a stale writer).
        """
        if not events:
            return True
        rows = [(action_id, e.sequence, e.event, e.data) for e in events]

        def append() -> None:
            self._update_one(
                "UPDATE jobs SET event_count = event_count + ?, updated_at = ? "
                "WHERE action_id = ? AND status = 'running' AND event_count = ?",
                (len(rows), _now_ms(), action_id, first_sequence),
            )
            self._conn.executemany(INSERT_EVENTS, rows)

        return await self._run(self._guarded_now, action_id, append)

    async def transition(
        self,
        action_id: str,
        target: JobStatus,
        *,
        first_sequence: int,
        events: Sequence[EventRow] = (),
        output: bytes | None = None,
        error: bytes | None = None,
        dropped_events: int | None = None,
        task_runs: Iterable[TaskRunRef] = (),
        run_states: Iterable[RunState] = (),
    ) -> bool:
        """Move a job to ``target`` and append ``events`` in one transaction.

        The ``WHERE`` clause requires a state in :func:`sources_of` ``(target)``
        and ``event_count == first_sequence``: a stale writer changes nothing.

        Args:
            events: events to append (pending chunks, then ``started`` or the
                terminal event); sequences from ``first_sequence``.
            output: completed output (JSON bytes); error: failed event data.
            task_runs: task ids to index (completed run/replay/batch_run).
            run_states: what a replay of this run needs (inputs, fingerprint).

        Returns:
            True when applied, False when refused (stale or illegal transition).

        Raises:
            JournalWriteFailed: SQLite failed (rolled back).
        """
        sources = sources_of(target)
        marks = ",".join("?" for _ in sources)
        rows = [(action_id, e.sequence, e.event, e.data) for e in events]
        refs = list(task_runs)
        states = [(action_id, -1 if r.result_index is None else r.result_index, r.state) for r in run_states]

        def apply() -> None:
            self._update_one(
                f"UPDATE jobs SET status = ?, event_count = event_count + ?, output = COALESCE(?, output), "
                f"error = COALESCE(?, error), dropped_events = COALESCE(?, dropped_events), updated_at = ? "
                f"WHERE action_id = ? AND event_count = ? AND archived = 0 AND status IN ({marks})",
                (
                    target.value,
                    len(rows),
                    output,
                    error,
                    dropped_events,
                    _now_ms(),
                    action_id,
                    first_sequence,
                    *sources,
                ),
            )
            if rows:
                self._conn.executemany(INSERT_EVENTS, rows)
            if refs:
                crew = fetch_scalar(self._conn, "SELECT crew_id FROM jobs WHERE action_id = ?", (action_id,))
                tenant = tenant_of(action_id)
                self._conn.executemany(
                    INSERT_TASK_RUNS, [(r.task_id, action_id, crew, r.result_index, tenant) for r in refs]
                )
            if states:
                self._conn.executemany(
                    "INSERT OR REPLACE INTO run_state (action_id, result_index, state) VALUES (?,?,?)", states
                )

        return await self._run(self._guarded_now, action_id, apply)

    async def set_provider_stop_observed(self, action_id: str, observed: bool) -> bool:
        """Record, once, whether a stopped job's worker really stopped (cancel/timeout)."""
        return await self._run(
            self._guarded_now,
            action_id,
            lambda: self._update_one(
                "UPDATE jobs SET provider_stop_observed = ?, updated_at = ? "
                "WHERE action_id = ? AND provider_stop_observed IS NULL AND status IN ('cancelled', 'failed')",
                (int(observed), _now_ms(), action_id),
            ),
        )

    async def import_jobs(self, jobs: Sequence[ImportedJob]) -> tuple[list[str], list[str], list[str]]:
        """Insert finished jobs migrated from a reference journal, with their events, in ONE transaction.

        A job whose action id is already in the journal is left as it is:
        with the same request hash it counts as present (importing twice
        changes nothing), with another as a conflict. The idempotency key is
        unknown to the reference journal and stored empty.

        Returns:
            ``(imported, present, conflicting)`` action ids.

        Raises:
            JournalWriteFailed: SQLite failed (rolled back: nothing imported).

        Source: docs/operating.md "Migrating from the reference sidecar"; ARCHITECTURE.md §5 (journal).
        """

        def import_now() -> tuple[list[str], list[str], list[str]]:
            outcome = self._write_now(insert_imported, self._conn, jobs)
            self._retained += len(outcome[0])
            return outcome

        return await self._run(import_now)

    async def archive(self, action_id: str) -> ArchiveOutcome:
        """Archive a terminal job: keep a tombstone row (the action id and its
        hash stay taken), delete its output, events and task index rows.

        Source: ARCHITECTURE.md §4 (``DELETE /jobs/{action_id}``).
        """

        def archive_now() -> ArchiveOutcome:
            self._ended.forget(action_id)
            outcome = self._write_now(tombstone, self._conn, action_id, _now_ms())
            if outcome is ArchiveOutcome.ARCHIVED:
                self._retained -= 1
            return outcome

        return await self._run(archive_now)


# ------------------------------------------------------------------ reads (run on the worker)
