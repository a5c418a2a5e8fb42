"""Opening a journal file: the worker start-up, the checks that refuse a file
that is not ours, and the migrations (:mod:`.store` holds the
:class:`~aip_crewai.sidecar.journal.store.Journal` that uses the connection).

Everything here that touches the connection runs on the journal's worker
thread, the one that will own the connection. Checks read only: a file that
is not an aip-crewai journal, or is damaged, is refused before anything is
written to it. Migrations (the SQL of :mod:`.schema`) are applied in
order, each in its own transaction, and tracked with ``PRAGMA user_version``.

Source: ARCHITECTURE.md §5 (journal, crash fence, forward-only migrations), ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from aip_crewai.plumbing.storage import apply_migrations, integrity_problems, start_worker
from aip_crewai.sidecar.errors import JournalCorrupt, JournalError, JournalForeign, JournalSchemaError
from aip_crewai.sidecar.journal import lock
from aip_crewai.sidecar.journal.schema import APPLICATION_ID, MIGRATIONS, OWN_TABLES

log = structlog.get_logger(__name__)

#: The schema version this code migrates to (module-level so tests can step through the migrations).
SCHEMA_VERSION = len(MIGRATIONS)

_COUNT_RETAINED = "SELECT COUNT(*) FROM jobs WHERE archived = 0"
#: What :func:`_connect` returns on the worker: (connection, page size in bytes, retained runs).
_Opened = tuple[sqlite3.Connection, int, int]


# ------------------------------------------------------------------ opening


async def start_journal_worker(
    path: Path, lock_fd: int | None, *, readonly: bool
) -> tuple[ThreadPoolExecutor, _Opened]:
    """Start a journal's worker thread and :func:`_connect` on it (the thread that will own the connection).

    Nothing leaks on failure, cancellation included (:func:`aip_crewai.plumbing.storage.start_worker`):
    the worker shuts down and ``lock_fd`` is released once no connection is open.
    """

    def abandon(opened: _Opened | None) -> None:
        try:
            if opened is not None:
                opened[0].close()
        finally:
            release(lock_fd)

    return await start_worker(lambda: _connect(path, readonly), name="aip-sidecar-journal", abandon=abandon)


def release(lock_fd: int | None) -> None:
    """Release the journal's process lock (None: a read-only journal holds none)."""
    if lock_fd is not None:
        lock.release_lock(lock_fd)


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


#: The first 16 bytes of every SQLite database file.
SQLITE_HEADER = b"SQLite format 3\x00"


def check_main_file(path: Path) -> None:
    """Refuse a journal path whose main file is not SQLite while its WAL remains.

    In WAL mode SQLite reads pages from ``<journal>-wal`` before the main
    file, so a file put in the journal's place (a train artifact, a copy)
    next to the old WAL would open as if it were the journal, page 1
    included, and be written over. Call it before SQLite opens the path.

    Raises:
        JournalForeign: the main file is empty or does not start with the
            SQLite header while a ``-wal`` or ``-shm`` file exists, or is
            non-empty and does not start with the SQLite header.

    Source: docs/security.md ("Tenant-scoped crew state": journal identity).
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        head = b""
    leftovers = [p for p in (Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()]
    if head == SQLITE_HEADER:
        return
    if head.lstrip()[:1] == b"[" and not leftovers:
        raise JournalForeign(
            f"{path} looks like a reference sidecar's JSON journal, not a SQLite journal; "
            f"migrate it with `aip-crewai journal import {path}` and point --journal "
            "(AIP_CREWAI_STATE_FILE) at the new file it prints"
        )
    if head or leftovers:
        beside = f", yet {leftovers[0].name} of a journal is beside it" if leftovers else ""
        raise JournalForeign(
            f"{path} is not a SQLite database{beside}: it is not this sidecar's journal "
            "(was it replaced?); restore the journal, or move these files away"
        )


#: The ``-wal`` file is truncated to this size after each checkpoint that resets it
#: (SQLite's auto-checkpoint runs every 1000 pages, 4 MiB at the default page size).
WAL_SIZE_LIMIT_BYTES = 4 * 1024 * 1024


def wal_bytes(path: Path) -> int:
    """Size of the journal's ``-wal`` file in bytes (0 when there is none)."""
    try:
        return os.stat(f"{path}-wal").st_size
    except FileNotFoundError:
        return 0


def _prepare(conn: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """Check, set the pragmas and migrate; see :meth:`Journal.open`. Returns (page size in bytes, retained runs)."""
    # Checks read only: a file that is not ours is refused before anything is written to it.
    _check_readable(conn, path)
    _check_integrity(conn, path)
    _check_identity(conn, path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
    _migrate(conn, path)
    return fetch_scalar(conn, "PRAGMA page_size") or 4096, fetch_scalar(conn, _COUNT_RETAINED) or 0


def _prepare_readonly(conn: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """Check the schema version, then SQLite's ``quick_check`` as the sidecar's start-up does
    (no writes); see :meth:`Journal.open_readonly`.

    Raises:
        JournalSchemaError: the schema is newer than this code.
        JournalCorrupt: the integrity check found damage (a damaged file is refused whole, never
            listed in part: a page it cannot read would hide jobs).
        sqlite3.DatabaseError: the file is not SQLite (:func:`_connect` names it).
    """
    version = fetch_scalar(conn, "PRAGMA user_version") or 0
    if version > SCHEMA_VERSION:
        raise JournalSchemaError(f"the journal {path} has schema {version}; this code knows {SCHEMA_VERSION}")
    _check_integrity(conn, path)
    return 4096, fetch_scalar(conn, _COUNT_RETAINED) or 0


# ------------------------------------------------------------------ helpers (run on the worker)


def fetch_rows(conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    """Every row of one statement (on the journal's worker thread)."""
    return conn.execute(sql, params).fetchall()


def fetch_scalar(conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()) -> Any:
    """The first column of the first row of one statement, or None without a row."""
    rows = fetch_rows(conn, sql, params)
    return rows[0][0] if rows else None


def _check_readable(conn: sqlite3.Connection, path: Path) -> None:
    """Raise JournalForeign when ``path`` is not a SQLite database at all."""
    try:
        fetch_scalar(conn, "SELECT COUNT(*) FROM sqlite_master")
    except sqlite3.DatabaseError as exc:
        if "malformed" in str(exc):
            raise _corrupt(path, str(exc)) from exc
        raise JournalForeign(
            f"the journal {path} is not a SQLite database ({exc}); it is not an aip-crewai journal. "
            "Point --journal at a new path or at a journal written by this sidecar"
        ) from exc


def _check_integrity(conn: sqlite3.Connection, path: Path) -> None:
    """Run SQLite's ``quick_check`` (reads every page once); raise JournalCorrupt on damage."""
    problems = integrity_problems(conn, 5)
    if problems:
        raise _corrupt(path, "; ".join(problems))


def _corrupt(path: Path, problem: str) -> JournalCorrupt:
    text = " ".join(problem.replace("*** in database main ***", "").split())[:200]
    return JournalCorrupt(
        f"the journal {path} is corrupt (SQLite integrity check: {text}); "
        "restore it from a backup, or move it aside to start with an empty journal"
    )


def _check_identity(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse a database that is not an aip-crewai journal.

    A journal has ``application_id`` 0 (written before migration 3) or
    :data:`APPLICATION_ID`; at schema version 0 it is empty (a new file),
    above it holds the ``jobs`` and ``events`` tables. Anything else belongs
    to another application: migrating it would add our tables to its data.
    """
    app_id = fetch_scalar(conn, "PRAGMA application_id") or 0
    version = fetch_scalar(conn, "PRAGMA user_version") or 0
    tables = {
        row[0]
        for row in fetch_rows(conn, "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    }
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
    """Apply the missing migrations in order, each in its own transaction (:func:`aip_crewai.plumbing.storage.apply_migrations`)."""
    apply_migrations(
        conn,
        MIGRATIONS[:SCHEMA_VERSION],
        too_new=lambda version, known: JournalSchemaError(
            f"the journal {path} has schema version {version}; this sidecar supports at most {known}"
        ),
        applied=lambda number: log.info("journal_migrated", schema_version=number),
    )


def file_identity(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` (symlinks not followed), or None when it cannot be read."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino
