"""The SQLite job journal: the sidecar's durable state, and its only SQL.

One file, owned by one process: an exclusive ``flock`` on ``<journal>.lock``
fences a second sidecar. WAL mode with ``synchronous=FULL``: every commit is
durable when it returns. Forward-only numbered migrations tracked with
``PRAGMA user_version``. Every write goes through one ``asyncio.Lock`` and one
``BEGIN IMMEDIATE`` transaction (aiosqlite shares one connection, so two
coroutines must never interleave statements of two transactions).

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
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite
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


# ------------------------------------------------------------------- journal


class Journal:
    """Async access to one journal file. Create with :meth:`open`; one per process."""

    def __init__(self, path: Path, conn: aiosqlite.Connection, lock_fd: int, page_size: int, retained: int) -> None:
        self.path = path
        self._conn = conn
        self._lock_fd: int | None = lock_fd
        self._page_size = page_size
        self._retained = retained
        self._write_lock = asyncio.Lock()
        self._readonly = False

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
        touched); then WAL, ``synchronous=FULL`` and migrations.

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
            try:
                conn = await aiosqlite.connect(str(path), isolation_level=None)
            except sqlite3.Error as exc:
                raise JournalError(f"cannot open the journal {path}: {exc}") from exc
            try:
                # Checks read only: a file that is not ours is refused before anything is written to it.
                await _check_readable(conn, path)
                await _check_integrity(conn, path)
                await _check_identity(conn, path)
                await conn.execute("PRAGMA journal_mode=WAL")
                await conn.execute("PRAGMA synchronous=FULL")
                await conn.execute("PRAGMA journal_size_limit=67108864")
                await _migrate(conn, path)
                page_size = (await _scalar(conn, "PRAGMA page_size")) or 4096
                retained = await _scalar(conn, "SELECT COUNT(*) FROM jobs WHERE archived = 0") or 0
            except sqlite3.Error as exc:
                await conn.close()
                raise JournalError(f"cannot use the journal {path}: {exc}") from exc
            except BaseException:
                await conn.close()
                raise
        except BaseException:
            fence.release_lock(lock_fd)
            raise
        return cls(path, conn, lock_fd, page_size, retained)

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
        try:
            conn = await aiosqlite.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
        except sqlite3.Error as exc:
            raise JournalError(f"cannot open the journal {path}: {exc}") from exc
        try:
            version = await _scalar(conn, "PRAGMA user_version") or 0
            if version > SCHEMA_VERSION:
                raise JournalSchemaError(f"the journal {path} has schema {version}; this code knows {SCHEMA_VERSION}")
            retained = await _scalar(conn, "SELECT COUNT(*) FROM jobs WHERE archived = 0") or 0
        except sqlite3.Error as exc:
            await conn.close()
            raise JournalError(f"{path} is not an aip-crewai journal: {exc}") from exc
        except BaseException:
            await conn.close()
            raise
        journal = cls(path, conn, -1, 4096, retained)
        journal._lock_fd = None
        journal._readonly = True
        return journal

    async def list_jobs(self, limit: int = 50) -> list[JobRecord]:
        """The newest ``limit`` jobs (archived tombstones included), newest first."""
        rows = await self._conn.execute_fetchall(
            f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY created_at DESC, action_id LIMIT ?", (limit,)
        )
        return [_record(row) for row in rows]

    async def close(self) -> None:
        """Close the connection and release the lock (idempotent)."""
        if self._readonly:
            self._readonly = False
            await self._conn.close()
            return
        if self._lock_fd is None:
            return
        try:
            await self._conn.close()
        finally:
            fence.release_lock(self._lock_fd)
            self._lock_fd = None

    @property
    def retained_runs(self) -> int:
        """Non-archived jobs (kept in memory: one process owns the file)."""
        return self._retained

    async def used_bytes(self) -> int:
        """Bytes of pages in use (file size minus free pages)."""
        pages = await _scalar(self._conn, "PRAGMA page_count") or 0
        free = await _scalar(self._conn, "PRAGMA freelist_count") or 0
        return int((pages - free) * self._page_size)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """One ``BEGIN IMMEDIATE`` .. ``COMMIT``; rolled back on any exception.

        Raises JournalWriteFailed for SQLite errors; :class:`_Stale` passes through.
        """
        async with self._write_lock:
            try:
                await self._conn.execute("BEGIN IMMEDIATE")
                yield self._conn
                await self._conn.execute("COMMIT")
            except BaseException as exc:
                if self._conn.in_transaction:
                    try:
                        await self._conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        log.error("journal_rollback_failed")
                if isinstance(exc, sqlite3.Error):
                    log.error("journal_write_failed", error_type=type(exc).__name__)
                    raise JournalWriteFailed() from exc
                raise

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
        found = await self._conn.execute_fetchall(
            "SELECT action_id, status, event_count FROM jobs WHERE status IN ('queued', 'running')"
        )
        recovered: list[tuple[str, JobStatus]] = []
        if not found:
            return recovered
        now = _now_ms()
        async with self._transaction() as conn:
            for action_id, status, count in found:
                running = status == JobStatus.RUNNING.value
                data = msgspec.json.encode({
                    "status": "failed",
                    "error_type": "SidecarRestarted",
                    "message": RESTARTED_RUNNING if running else RESTARTED_QUEUED,
                    "uncertain_outcome": running,
                })
                cur = await conn.execute(
                    "UPDATE jobs SET status = 'failed', error = ?, event_count = event_count + 1, updated_at = ? "
                    "WHERE action_id = ? AND status = ? AND event_count = ?",
                    (data, now, action_id, status, count),
                )
                if cur.rowcount == 1:
                    await conn.execute("INSERT INTO events VALUES (?, ?, 'failed', ?)", (action_id, count, data))
                    recovered.append((action_id, JobStatus(status)))
        return recovered

    # -------------------------------------------------------------- reads

    async def get(self, action_id: str) -> JobRecord | None:
        """The job row of ``action_id`` (archived tombstones included), or None."""
        rows = await self._conn.execute_fetchall(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE action_id = ?", (action_id,))
        return _record(rows[0]) if rows else None

    async def summary(self, action_id: str) -> tuple[JobStatus, int, bool] | None:
        """``(status, event_count, archived)`` without the output/error blobs, or None."""
        rows = await self._conn.execute_fetchall(
            "SELECT status, event_count, archived FROM jobs WHERE action_id = ?", (action_id,)
        )
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
        rows = await self._conn.execute_fetchall(
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
        rows = await self._conn.execute_fetchall(
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
        existing = await self.get(job.action_id)
        if existing is not None:
            return existing, False
        if self._retained >= max_retained_runs:
            raise JournalFull(f"retained runs are at the limit ({max_retained_runs}); archive terminal jobs")
        if await self.used_bytes() >= max_bytes:
            raise JournalFull(f"the journal reached its size bound ({max_bytes} bytes); archive terminal jobs")
        now = _now_ms()
        async with self._transaction() as conn:
            rows = await conn.execute_fetchall(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE action_id = ?",
                                               (job.action_id,))
            if rows:  # admitted concurrently between the read above and this transaction
                return _record(rows[0]), False
            await conn.execute(
                "INSERT INTO jobs (action_id, crew_id, operation, request_hash, idempotency_key, timeout_ms, status, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, 'queued', ?, ?)",
                (job.action_id, job.crew_id, job.operation, job.request_hash, job.idempotency_key, job.timeout_ms,
                 now, now),
            )
        self._retained += 1
        record = await self.get(job.action_id)
        if record is None:  # pragma: no cover - committed above
            raise JournalWriteFailed()
        return record, True

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
        try:
            async with self._transaction() as conn:
                cur = await conn.execute(
                    "UPDATE jobs SET event_count = event_count + ?, updated_at = ? "
                    "WHERE action_id = ? AND status = 'running' AND event_count = ?",
                    (len(events), _now_ms(), action_id, first_sequence),
                )
                if cur.rowcount != 1:
                    raise _Stale
                await conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?)",
                                       [(action_id, e.sequence, e.event, e.data) for e in events])
        except _Stale:
            return False
        return True

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
        try:
            async with self._transaction() as conn:
                cur = await conn.execute(
                    f"UPDATE jobs SET status = ?, event_count = event_count + ?, output = COALESCE(?, output), "
                    f"error = COALESCE(?, error), dropped_events = COALESCE(?, dropped_events), updated_at = ? "
                    f"WHERE action_id = ? AND event_count = ? AND archived = 0 AND status IN ({marks})",
                    (target.value, len(events), output, error, dropped_events, _now_ms(), action_id,
                     first_sequence, *sources),
                )
                if cur.rowcount != 1:
                    raise _Stale
                if events:
                    await conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?)",
                                           [(action_id, e.sequence, e.event, e.data) for e in events])
                refs = list(task_runs)
                if refs:
                    crew = await _scalar(conn, "SELECT crew_id FROM jobs WHERE action_id = ?", (action_id,))
                    await conn.executemany(
                        "INSERT OR IGNORE INTO task_runs (task_id, action_id, crew_id, result_index) VALUES (?,?,?,?)",
                        [(r.task_id, action_id, crew, r.result_index) for r in refs],
                    )
        except _Stale:
            return False
        return True

    async def set_provider_stop_observed(self, action_id: str, observed: bool) -> bool:
        """Record, once, whether a stopped job's worker really stopped (cancel/timeout)."""
        try:
            async with self._transaction() as conn:
                cur = await conn.execute(
                    "UPDATE jobs SET provider_stop_observed = ?, updated_at = ? "
                    "WHERE action_id = ? AND provider_stop_observed IS NULL AND status IN ('cancelled', 'failed')",
                    (int(observed), _now_ms(), action_id),
                )
                if cur.rowcount != 1:
                    raise _Stale
        except _Stale:
            return False
        return True

    async def archive(self, action_id: str) -> ArchiveOutcome:
        """Archive a terminal job: keep a tombstone row (the action id and its
        hash stay fenced), delete its output, events and task index rows.

        Source: DESIGN.md §4 (``DELETE /jobs/{action_id}``).
        """
        async with self._transaction() as conn:
            rows = await conn.execute_fetchall("SELECT status, archived FROM jobs WHERE action_id = ?", (action_id,))
            if not rows:
                return ArchiveOutcome.NOT_FOUND
            status, archived = rows[0]
            if archived:
                return ArchiveOutcome.ALREADY_ARCHIVED
            if not JobStatus(status).terminal:
                return ArchiveOutcome.NOT_TERMINAL
            await conn.execute(
                "UPDATE jobs SET archived = 1, output = NULL, updated_at = ? WHERE action_id = ? AND archived = 0",
                (_now_ms(), action_id),
            )
            await conn.execute("DELETE FROM events WHERE action_id = ?", (action_id,))
            await conn.execute("DELETE FROM task_runs WHERE action_id = ?", (action_id,))
        self._retained -= 1
        return ArchiveOutcome.ARCHIVED


# ------------------------------------------------------------------ helpers


async def _scalar(conn: aiosqlite.Connection, sql: str, params: Sequence[Any] = ()) -> Any:
    rows = await conn.execute_fetchall(sql, params)
    return rows[0][0] if rows else None


async def _check_readable(conn: aiosqlite.Connection, path: Path) -> None:
    """Raise JournalForeign when ``path`` is not a SQLite database at all."""
    try:
        await _scalar(conn, "SELECT COUNT(*) FROM sqlite_master")
    except sqlite3.DatabaseError as exc:
        if "malformed" in str(exc):
            raise _corrupt(path, str(exc)) from exc
        raise JournalForeign(
            f"the journal {path} is not a SQLite database ({exc}); it is not an aip-crewai journal. "
            "Point --journal at a new path or at a journal written by this sidecar"
        ) from exc


async def _check_integrity(conn: aiosqlite.Connection, path: Path) -> None:
    """Run SQLite's ``quick_check`` (reads every page once); raise JournalCorrupt on damage."""
    try:
        rows = await conn.execute_fetchall("PRAGMA quick_check(5)")
        problems = [str(row[0]) for row in rows if str(row[0]) != "ok"]
    except sqlite3.DatabaseError as exc:
        problems = [str(exc)]
    if problems:
        raise _corrupt(path, "; ".join(problems))


def _corrupt(path: Path, problem: str) -> JournalCorrupt:
    text = " ".join(problem.replace("*** in database main ***", "").split())[:200]
    return JournalCorrupt(f"the journal {path} is corrupt (SQLite integrity check: {text}); "
                          "restore it from a backup, or move it aside to start with an empty journal")


async def _check_identity(conn: aiosqlite.Connection, path: Path) -> None:
    """Refuse a database that is not an aip-crewai journal.

    A journal has ``application_id`` 0 (written before migration 3) or
    :data:`APPLICATION_ID`; at schema version 0 it is empty (a new file),
    above it holds the ``jobs`` and ``events`` tables. Anything else belongs
    to another application: migrating it would add our tables to its data.
    """
    app_id = await _scalar(conn, "PRAGMA application_id") or 0
    version = await _scalar(conn, "PRAGMA user_version") or 0
    tables = {row[0] for row in await conn.execute_fetchall(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
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


async def _migrate(conn: aiosqlite.Connection, path: Path) -> None:
    """Apply the missing migrations in order, each in its own transaction."""
    version = await _scalar(conn, "PRAGMA user_version") or 0
    if version > SCHEMA_VERSION:
        raise JournalSchemaError(
            f"the journal {path} has schema version {version}; this sidecar supports at most {SCHEMA_VERSION}"
        )
    for number in range(version + 1, SCHEMA_VERSION + 1):
        await conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(MIGRATIONS[number - 1]):
                await conn.execute(statement)
            await conn.execute(f"PRAGMA user_version = {number}")
            await conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                await conn.execute("ROLLBACK")
            raise
        log.info("journal_migrated", schema_version=number)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
