"""The SQLite job journal: the sidecar's durable state, and its only SQL.

One file, owned by one process: an exclusive ``flock`` on ``<journal>.lock``
fences a second sidecar. WAL mode with ``synchronous=FULL``: every commit is
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

Source: DESIGN.md §5 (journal, durability, crash fence), STYLE.md (Storage).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog

from aip_crewai.sidecar import fence
from aip_crewai.sidecar.errors import (
    JournalCorrupt,
    JournalError,
    JournalForeign,
    JournalFull,
    JournalSchemaError,
    JournalWriteFailed,
)
from aip_crewai.sidecar.jobs import (
    ArchiveOutcome,
    EventRow,
    JobRecord,
    JobStatus,
    NewJob,
    TaskRunRef,
    sources_of,
)
from aip_crewai.sidecar.journal_schema import APPLICATION_ID, MIGRATIONS, OWN_TABLES

log = structlog.get_logger(__name__)

#: Crash fence messages (DESIGN.md §5). A queued job never reached CrewAI
#: (``started`` commits before execution), so its outcome is certain.
RESTARTED_RUNNING = "sidecar restarted before CrewAI produced a terminal result"
RESTARTED_QUEUED = "sidecar restarted before the job started; CrewAI never ran it"

# --------------------------------------------------------------- migrations

#: The schema version this code migrates to (module-level so tests can step through the migrations).
SCHEMA_VERSION = len(MIGRATIONS)

# ------------------------------------------------------------------- records

_JOB_COLUMNS = (
    "action_id, crew_id, operation, request_hash, idempotency_key, timeout_ms, status, event_count, output, "
    "error, dropped_events, provider_stop_observed, archived, created_at, updated_at"
)
_GET_JOB = f"SELECT {_JOB_COLUMNS} FROM jobs WHERE action_id = ?"
_COUNT_RETAINED = "SELECT COUNT(*) FROM jobs WHERE archived = 0"
_INSERT_EVENTS = "INSERT INTO events VALUES (?, ?, ?, ?)"


def _record(row: Sequence[Any]) -> JobRecord:
    return JobRecord(
        action_id=row[0], crew_id=row[1], operation=row[2], request_hash=row[3], idempotency_key=row[4],
        timeout_ms=row[5], status=JobStatus(row[6]), event_count=row[7], output=row[8], error=row[9],
        dropped_events=row[10], provider_stop_observed=None if row[11] is None else bool(row[11]),
        archived=bool(row[12]), created_at=row[13], updated_at=row[14],
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Stale(Exception):
    """Internal: the guarded update matched no row; roll back quietly."""


_T = TypeVar("_T")
#: What :func:`_connect` returns on the worker: (connection, page size in bytes, retained runs).
_Opened = tuple[sqlite3.Connection, int, int]

# ------------------------------------------------------------------- journal


class Journal:
    """Async access to one journal file. Create with :meth:`open`; one per process."""

    def __init__(self, path: Path, conn: sqlite3.Connection, worker: ThreadPoolExecutor, lock_fd: int | None,
                 page_size: int, retained: int) -> None:
        self.path = path
        self._conn = conn
        self._worker = worker
        self._lock_fd = lock_fd  # None when read-only
        self._page_size = page_size
        self._retained = retained  # changed on the worker only
        self._closed = False

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
        (:func:`_check_identity`: another application's database is never
        touched); then WAL, ``synchronous=FULL`` and migrations. The worker
        thread and the lock never outlive a failed (or cancelled) open.

        Raises:
            JournalLocked: another process holds the lock ("already owned by
                another active sidecar").
            JournalInsecure: a permission or file-type rule is broken.
            JournalForeign: the file is not SQLite, or another application's database.
            JournalCorrupt: the integrity check failed.
            JournalSchemaError: the file's schema is newer than this code.
            JournalError: SQLite cannot open the file.

        Source: DESIGN.md §5 (Journal).
        """
        path = Path(path).absolute()
        fence.check_parent(path.parent)
        lock_fd = fence.acquire_lock(path)
        try:
            for candidate in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                fence.check_private_file(candidate)
            fence.create_private_file(path)
        except BaseException:
            fence.release_lock(lock_fd)
            raise
        worker, (conn, page_size, retained) = await _start_worker(path, lock_fd, readonly=False)
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
        worker, (conn, page_size, retained) = await _start_worker(path, None, readonly=True)
        return cls(path, conn, worker, None, page_size, retained)

    async def list_jobs(self, limit: int = 50) -> list[JobRecord]:
        """The newest ``limit`` jobs (archived tombstones included), newest first."""
        rows = await self._fetch(f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY created_at DESC, action_id LIMIT ?",
                                 (limit,))
        return [_record(row) for row in rows]

    async def close(self) -> None:
        """Close the connection (on the worker), stop the worker and release the lock (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._run(self._conn.close)
        finally:
            self._worker.shutdown(wait=True)
            _release(self._lock_fd)
            self._lock_fd = None

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
            return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        except JournalWriteFailed as exc:
            log.error("journal_write_failed", error_type=type(exc.__cause__).__name__)
            raise

    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return await self._run(_rows, self._conn, sql, params)

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

    def _guarded_now(self, fn: Callable[[], None]) -> bool:
        """:meth:`_write_now` of a guarded update: False (rolled back) when ``fn`` raises :class:`_Stale`."""
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
        pages = _scalar(self._conn, "PRAGMA page_count") or 0
        free = _scalar(self._conn, "PRAGMA freelist_count") or 0
        return int((pages - free) * self._page_size)

    # ------------------------------------------------------------ crash fence

    async def recover(self) -> list[tuple[str, JobStatus]]:
        """Fail every job left ``queued`` or ``running`` by a previous process.

        Each gets a terminal ``failed`` event ``{status, error_type:
        "SidecarRestarted", message, uncertain_outcome}``: uncertain (True)
        for running jobs, certain (False) for queued ones, which never reached
        CrewAI. Nothing is ever re-run. One transaction.

        Returns:
            ``[(action_id, previous status)]``.

        Source: DESIGN.md §5 (Crash fence).
        """
        def fail(found: list[Any], now: int) -> list[tuple[str, JobStatus]]:
            recovered: list[tuple[str, JobStatus]] = []
            for action_id, status, count in found:
                running = status == JobStatus.RUNNING.value
                data = msgspec.json.encode({
                    "status": "failed",
                    "error_type": "SidecarRestarted",
                    "message": RESTARTED_RUNNING if running else RESTARTED_QUEUED,
                    "uncertain_outcome": running,
                })
                cur = self._conn.execute(
                    "UPDATE jobs SET status = 'failed', error = ?, event_count = event_count + 1, updated_at = ? "
                    "WHERE action_id = ? AND status = ? AND event_count = ?",
                    (data, now, action_id, status, count),
                )
                if cur.rowcount == 1:
                    self._conn.execute("INSERT INTO events VALUES (?, ?, 'failed', ?)", (action_id, count, data))
                    recovered.append((action_id, JobStatus(status)))
            return recovered

        def recover_now() -> list[tuple[str, JobStatus]]:
            found = _rows(self._conn,
                          "SELECT action_id, status, event_count FROM jobs WHERE status IN ('queued', 'running')")
            return self._write_now(fail, found, _now_ms()) if found else []

        return await self._run(recover_now)

    # -------------------------------------------------------------- reads

    async def get(self, action_id: str) -> JobRecord | None:
        """The job row of ``action_id`` (archived tombstones included), or None."""
        rows = await self._fetch(_GET_JOB, (action_id,))
        return _record(rows[0]) if rows else None

    async def summary(self, action_id: str) -> tuple[JobStatus, int, bool] | None:
        """``(status, event_count, archived)`` without the output/error blobs, or None."""
        rows = await self._fetch("SELECT status, event_count, archived FROM jobs WHERE action_id = ?", (action_id,))
        return (JobStatus(rows[0][0]), rows[0][1], bool(rows[0][2])) if rows else None

    async def read_events(
        self, action_id: str, cursor: int, *, limit: int = 1000, max_bytes: int | None = None
    ) -> list[EventRow]:
        """Committed events of ``action_id`` with ``sequence >= cursor``, in order.

        Args:
            limit: at most this many events.
            max_bytes: stop before the data bytes would exceed this (the
                first event is always returned).
        """
        rows = await self._fetch(
            "SELECT sequence, event, data FROM events WHERE action_id = ? AND sequence >= ? "
            "ORDER BY sequence LIMIT ?",
            (action_id, cursor, limit),
        )
        out: list[EventRow] = []
        total = 0
        for sequence, event, data in rows:
            total += len(data)
            if max_bytes is not None and out and total > max_bytes:
                break
            out.append(EventRow(sequence, event, bytes(data)))
        return out

    async def find_task_run(self, crew_id: str, task_id: str) -> bytes | None:
        """Output (JSON bytes of one serialized CrewOutput) of the latest retained
        completed job of ``crew_id`` whose ``tasks_output`` holds ``task_id``.

        For a batch_run the matching item of ``results`` is returned. None
        when no such run exists (other crews' runs never match).
        """
        rows = await self._fetch(
            "SELECT j.output, t.result_index FROM task_runs t JOIN jobs j ON j.action_id = t.action_id "
            "WHERE t.task_id = ? AND t.crew_id = ? AND j.archived = 0 AND j.status = 'completed' "
            "ORDER BY t.rowid DESC LIMIT 1",
            (task_id, crew_id),
        )
        if not rows or rows[0][0] is None:
            return None
        output, index = rows[0]
        if index is None:
            return bytes(output)
        results = msgspec.json.decode(output).get("results") or []
        return msgspec.json.encode(results[index]) if 0 <= index < len(results) else None

    # -------------------------------------------------------------- writes

    async def admit(self, job: NewJob, *, max_retained_runs: int, max_bytes: int) -> tuple[JobRecord, bool]:
        """Insert a ``queued`` job row, or return the existing row of its action id.

        Returns:
            ``(record, created)``; ``created`` is False when the action id
            already existed (the caller compares request hashes).

        Raises:
            JournalFull: retained-run limit or size bound reached (nothing written).
            JournalWriteFailed: the insert failed (rolled back: nothing half-admitted).

        Source: DESIGN.md §4 (admission), §5 (durability).
        """
        def insert(now: int) -> JobRecord:
            self._conn.execute(
                "INSERT INTO jobs (action_id, crew_id, operation, request_hash, idempotency_key, timeout_ms, status, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, 'queued', ?, ?)",
                (job.action_id, job.crew_id, job.operation, job.request_hash, job.idempotency_key, job.timeout_ms,
                 now, now),
            )
            return _record(_rows(self._conn, _GET_JOB, (job.action_id,))[0])

        def admit_now() -> tuple[JobRecord, bool]:
            # Calls are serialized on the worker: no other admission can slip in between the read and the insert.
            existing = _rows(self._conn, _GET_JOB, (job.action_id,))
            if existing:
                return _record(existing[0]), False
            if self._retained >= max_retained_runs:
                raise JournalFull(f"retained runs are at the limit ({max_retained_runs}); archive terminal jobs")
            if self._used_bytes_now() >= max_bytes:
                raise JournalFull(f"the journal reached its size bound ({max_bytes} bytes); archive terminal jobs")
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
            self._conn.executemany(_INSERT_EVENTS, rows)

        return await self._run(self._guarded_now, append)

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
    ) -> bool:
        """Move a job to ``target`` and append ``events`` in one transaction.

        The ``WHERE`` clause requires a state in :func:`sources_of` ``(target)``
        and ``event_count == first_sequence``: a stale writer changes nothing.

        Args:
            events: events to append (pending chunks, then ``started`` or the
                terminal event); sequences from ``first_sequence``.
            output: completed output (JSON bytes); error: failed event data.
            task_runs: task ids to index (completed run/replay/batch_run).

        Returns:
            True when applied, False when refused (stale or illegal transition).

        Raises:
            JournalWriteFailed: SQLite failed (rolled back).
        """
        sources = sources_of(target)
        marks = ",".join("?" for _ in sources)
        rows = [(action_id, e.sequence, e.event, e.data) for e in events]
        refs = list(task_runs)

        def apply() -> None:
            self._update_one(
                f"UPDATE jobs SET status = ?, event_count = event_count + ?, output = COALESCE(?, output), "
                f"error = COALESCE(?, error), dropped_events = COALESCE(?, dropped_events), updated_at = ? "
                f"WHERE action_id = ? AND event_count = ? AND archived = 0 AND status IN ({marks})",
                (target.value, len(rows), output, error, dropped_events, _now_ms(), action_id,
                 first_sequence, *sources),
            )
            if rows:
                self._conn.executemany(_INSERT_EVENTS, rows)
            if refs:
                crew = _scalar(self._conn, "SELECT crew_id FROM jobs WHERE action_id = ?", (action_id,))
                self._conn.executemany(
                    "INSERT OR IGNORE INTO task_runs (task_id, action_id, crew_id, result_index) VALUES (?,?,?,?)",
                    [(r.task_id, action_id, crew, r.result_index) for r in refs],
                )

        return await self._run(self._guarded_now, apply)

    async def set_provider_stop_observed(self, action_id: str, observed: bool) -> bool:
        """Record, once, whether a stopped job's worker really stopped (cancel/timeout)."""
        return await self._run(self._guarded_now, lambda: self._update_one(
            "UPDATE jobs SET provider_stop_observed = ?, updated_at = ? "
            "WHERE action_id = ? AND provider_stop_observed IS NULL AND status IN ('cancelled', 'failed')",
            (int(observed), _now_ms(), action_id),
        ))

    async def archive(self, action_id: str) -> ArchiveOutcome:
        """Archive a terminal job: keep a tombstone row (the action id and its
        hash stay fenced), delete its output, events and task index rows.

        Source: DESIGN.md §4 (``DELETE /jobs/{action_id}``).
        """
        def tombstone() -> ArchiveOutcome:
            rows = _rows(self._conn, "SELECT status, archived FROM jobs WHERE action_id = ?", (action_id,))
            if not rows:
                return ArchiveOutcome.NOT_FOUND
            status, archived = rows[0]
            if archived:
                return ArchiveOutcome.ALREADY_ARCHIVED
            if not JobStatus(status).terminal:
                return ArchiveOutcome.NOT_TERMINAL
            self._conn.execute(
                "UPDATE jobs SET archived = 1, output = NULL, updated_at = ? WHERE action_id = ? AND archived = 0",
                (_now_ms(), action_id),
            )
            self._conn.execute("DELETE FROM events WHERE action_id = ?", (action_id,))
            self._conn.execute("DELETE FROM task_runs WHERE action_id = ?", (action_id,))
            return ArchiveOutcome.ARCHIVED

        def archive_now() -> ArchiveOutcome:
            outcome = self._write_now(tombstone)
            if outcome is ArchiveOutcome.ARCHIVED:
                self._retained -= 1
            return outcome

        return await self._run(archive_now)


# ------------------------------------------------------------------ opening


async def _start_worker(path: Path, lock_fd: int | None, *, readonly: bool) -> tuple[ThreadPoolExecutor, _Opened]:
    """Start a journal's worker thread and :func:`_connect` on it (the thread that will own the connection).

    Nothing leaks on failure, cancellation included: the worker shuts down and
    ``lock_fd`` is released once no connection is open (by the worker itself,
    after the connect ends, when the caller gave up mid-open).
    """
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aip-sidecar-journal")
    opening = worker.submit(_connect, path, readonly)
    try:
        return worker, await asyncio.wrap_future(opening)
    except BaseException:
        if opening.done() and not opening.cancelled() and opening.exception() is not None:
            _release(lock_fd)  # the connect failed and closed its connection
        else:
            worker.submit(_abandon, opening, lock_fd)
        worker.shutdown(wait=False)
        raise


def _abandon(opening: Future[_Opened], lock_fd: int | None) -> None:
    """(On the worker, after :func:`_connect`.) Close what an abandoned open opened, then release its lock."""
    try:
        if not opening.cancelled() and opening.exception() is None:
            opening.result()[0].close()
    finally:
        _release(lock_fd)


def _release(lock_fd: int | None) -> None:
    if lock_fd is not None:
        fence.release_lock(lock_fd)


def _connect(path: Path, readonly: bool) -> _Opened:
    """Connect (on the worker that will own the connection), then :func:`_prepare`, or
    :func:`_prepare_readonly` over a ``mode=ro`` URI; a connection that fails to prepare is closed."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro" if readonly else str(path), uri=readonly, isolation_level=None)
    except sqlite3.Error as exc:
        raise JournalError(f"cannot open the journal {path}: {exc}") from exc
    try:
        page_size, retained = (_prepare_readonly if readonly else _prepare)(conn, path)
    except sqlite3.Error as exc:
        conn.close()
        unusable = f"{path} is not an aip-crewai journal" if readonly else f"cannot use the journal {path}"
        raise JournalError(f"{unusable}: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn, page_size, retained


def _prepare(conn: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """Check, set the pragmas and migrate; see :meth:`Journal.open`. Returns (page size in bytes, retained runs)."""
    # Checks read only: a file that is not ours is refused before anything is written to it.
    _check_readable(conn, path)
    _check_integrity(conn, path)
    _check_identity(conn, path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA journal_size_limit=67108864")
    _migrate(conn, path)
    return _scalar(conn, "PRAGMA page_size") or 4096, _scalar(conn, _COUNT_RETAINED) or 0


def _prepare_readonly(conn: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """Check the schema version only (no writes); see :meth:`Journal.open_readonly`."""
    version = _scalar(conn, "PRAGMA user_version") or 0
    if version > SCHEMA_VERSION:
        raise JournalSchemaError(f"the journal {path} has schema {version}; this code knows {SCHEMA_VERSION}")
    return 4096, _scalar(conn, _COUNT_RETAINED) or 0


# ------------------------------------------------------------------ helpers (run on the worker)


def _rows(conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    return conn.execute(sql, params).fetchall()


def _scalar(conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()) -> Any:
    rows = _rows(conn, sql, params)
    return rows[0][0] if rows else None


def _check_readable(conn: sqlite3.Connection, path: Path) -> None:
    """Raise JournalForeign when ``path`` is not a SQLite database at all."""
    try:
        _scalar(conn, "SELECT COUNT(*) FROM sqlite_master")
    except sqlite3.DatabaseError as exc:
        if "malformed" in str(exc):
            raise _corrupt(path, str(exc)) from exc
        raise JournalForeign(
            f"the journal {path} is not a SQLite database ({exc}); it is not an aip-crewai journal. "
            "Point --journal at a new path or at a journal written by this sidecar"
        ) from exc


def _check_integrity(conn: sqlite3.Connection, path: Path) -> None:
    """Run SQLite's ``quick_check`` (reads every page once); raise JournalCorrupt on damage."""
    try:
        problems = [str(row[0]) for row in _rows(conn, "PRAGMA quick_check(5)") if str(row[0]) != "ok"]
    except sqlite3.DatabaseError as exc:
        problems = [str(exc)]
    if problems:
        raise _corrupt(path, "; ".join(problems))


def _corrupt(path: Path, problem: str) -> JournalCorrupt:
    text = " ".join(problem.replace("*** in database main ***", "").split())[:200]
    return JournalCorrupt(f"the journal {path} is corrupt (SQLite integrity check: {text}); "
                          "restore it from a backup, or move it aside to start with an empty journal")


def _check_identity(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse a database that is not an aip-crewai journal.

    A journal has ``application_id`` 0 (written before migration 3) or
    :data:`APPLICATION_ID`; at schema version 0 it is empty (a new file),
    above it holds the ``jobs`` and ``events`` tables. Anything else belongs
    to another application: migrating it would add our tables to its data.
    """
    app_id = _scalar(conn, "PRAGMA application_id") or 0
    version = _scalar(conn, "PRAGMA user_version") or 0
    tables = {row[0] for row in _rows(
        conn, "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
    problem = None
    if app_id not in (0, APPLICATION_ID):
        problem = f"its SQLite application_id is {app_id}, not {APPLICATION_ID}"
    elif version == 0 and tables:
        problem = f"it holds tables of another application ({', '.join(sorted(tables)[:5])})"
    elif version > 0 and not OWN_TABLES <= tables:
        problem = f"it is at schema version {version} but lacks the tables {', '.join(sorted(OWN_TABLES - tables))}"
    if problem:
        raise JournalForeign(
            f"the journal {path} is not an aip-crewai journal: {problem}. "
            "Point --journal at a new path or at a journal written by this sidecar"
        )


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Apply the missing migrations in order, each in its own transaction."""
    version = _scalar(conn, "PRAGMA user_version") or 0
    if version > SCHEMA_VERSION:
        raise JournalSchemaError(
            f"the journal {path} has schema version {version}; this sidecar supports at most {SCHEMA_VERSION}"
        )
    for number in range(version + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(MIGRATIONS[number - 1]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {number}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        log.info("journal_migrated", schema_version=number)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
