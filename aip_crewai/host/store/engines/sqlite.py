"""The SQLite engine of the host store (the embedded default): opening the file on its worker thread,
the file-location rules, the pre-flight check of an existing file, and the one-host lock.

Source: ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ....plumbing.storage import (
    acquire_lock,
    database_files,
    directory_problem,
    integrity_problems,
    private_file_problem,
)
from ..migrations import migrate
from ..records import InsecureStorePath, StoreError, StoreLocked, UnusableStore

_T = TypeVar("_T")

#: SQLite's primary result codes that mean "the file cannot take this call now", not a bug in the
#: store's SQL: the disk is full (``SQLITE_FULL``, also ``PRAGMA max_page_count`` reached), an I/O error
#: (``SQLITE_IOERR``: a failing disk, a file system gone), the file turned read-only (``SQLITE_READONLY``:
#: a file system remounted read-only, its modes changed), or an outside process held the write lock past
#: the busy timeout (``SQLITE_BUSY``). Each answers 503 ``store.unavailable`` (docs/operating.md "Faults
#: of a SQLite store"); every other SQLite error stays an internal error.
UNWRITABLE_CODES = {5: "SQLITE_BUSY", 8: "SQLITE_READONLY", 10: "SQLITE_IOERR", 13: "SQLITE_FULL"}
#: Their messages, for a Python without ``sqlite3.Error.sqlite_errorcode`` (before 3.11).
_UNWRITABLE_MESSAGES = {
    "database is locked": "SQLITE_BUSY",
    "attempt to write a readonly database": "SQLITE_READONLY",
    "disk I/O error": "SQLITE_IOERR",
    "database or disk is full": "SQLITE_FULL",
}
#: How long a call that failed with one of :data:`UNWRITABLE_CODES` keeps the store unwritable for
#: ``/ready`` when no write has succeeded since, seconds (as the sidecar's failed admission write keeps
#: its ``/health`` degraded).
UNWRITABLE_S = 30.0


class StoreFileUnwritable(Exception):
    """The store file cannot take a call now (one of :data:`UNWRITABLE_CODES`): an outage, not a bug;
    the store raises ``StoreUnavailable`` for it. Carries the SQLite message and result code name."""


def unwritable_name(exc: BaseException) -> str | None:
    """The result code name (``SQLITE_FULL``...) when ``exc`` is a SQLite error of
    :data:`UNWRITABLE_CODES`, else None. Pure."""
    if not isinstance(exc, sqlite3.Error):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return UNWRITABLE_CODES.get(int(code) & 0xFF)  # an extended code (SQLITE_IOERR_WRITE) keeps its primary
    return _UNWRITABLE_MESSAGES.get(str(exc))


def connect_sqlite(path: str) -> sqlite3.Connection:
    """Open the connection (on the worker thread that will own it): WAL,
    ``synchronous=FULL``, foreign keys, a busy timeout, then migrations."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        mode = (conn.execute("PRAGMA journal_mode=WAL").fetchone() or ("",))[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"SQLite refused WAL mode for {path} (got {mode!r})")
        for pragma in ("synchronous=FULL", "foreign_keys=ON", "busy_timeout=10000"):
            conn.execute(f"PRAGMA {pragma}")
        migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def check_location(path: Path) -> None:
    """Refuse an unsafe store location (no I/O beyond ``stat``; the shared
    checks of :mod:`aip_crewai.plumbing.storage`).

    Raises:
        InsecureStorePath: the directory is missing or group/world-writable;
            the file (or its ``-wal``/``-shm``) is a symlink, not a regular
            file, or has any permission bit beyond 0600.
    """
    problem = directory_problem(path.parent, "store directory") or next(
        (p for p in map(lambda c: private_file_problem(c, "store file"), database_files(path)) if p), None
    )
    if problem is not None:
        raise InsecureStorePath(problem)


def check_store_file(path: Path) -> None:
    """Refuse, before serving, a store file that cannot be this host's store
    (read-only: nothing is written, so an operator's file is never touched).

    An absent or empty file is fine (a new store). Otherwise the file must
    be SQLite, pass ``quick_check``, and either be empty at schema version 0
    or hold the ``actions`` table: migrating another application's database
    would add our tables to its data.

    Raises:
        UnusableStore: with a message naming the file and what to do.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    advice = "point host.store at a new path, or restore the store from a backup"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise UnusableStore(f"store file {path} cannot be opened ({exc}); {advice}") from exc
    try:
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
        except sqlite3.DatabaseError as exc:
            raise UnusableStore(f"store file {path} is not a SQLite database ({exc}); {advice}") from exc
        problems = integrity_problems(conn, 3)
        if problems:
            text = " ".join(" ".join(problems).replace("*** in database main ***", "").split())[:200]
            raise UnusableStore(f"store file {path} is corrupt (SQLite integrity check: {text}); {advice}")
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            ).fetchall()
        }
        if (version == 0 and tables) or (version > 0 and "actions" not in tables):
            shown = ", ".join(sorted(tables)[:5]) or "none"
            raise UnusableStore(
                f"store file {path} is not an aip-crewai host store (schema version {version}, "
                f"tables: {shown}); {advice}"
            )
    finally:
        conn.close()


class SqliteDb:
    """The embedded engine: one ``sqlite3`` connection (WAL, autocommit) owned by the worker thread."""

    integrity_error: type[Exception] = sqlite3.IntegrityError
    engine = "sqlite"
    #: A full disk, an I/O error, a read-only file, a write lock held outside (:data:`UNWRITABLE_CODES`).
    unavailable_errors: tuple[type[BaseException], ...] = (StoreFileUnwritable,)
    call_timeout_s: float | None = None  # one process on a local file: no store-call bound of its own

    def __init__(self, conn: sqlite3.Connection, *, unwritable_s: float = UNWRITABLE_S) -> None:
        self.conn = conn
        #: How long a failure keeps :meth:`probe` failing without a write committed since, seconds.
        self.unwritable_s = unwritable_s
        #: The last call that failed with one of UNWRITABLE_CODES: (monotonic s, its message), until a
        #: later write commits (:meth:`probe` raises meanwhile, for at most ``unwritable_s``).
        self._unwritable: tuple[float, str] | None = None

    def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the one connection (one worker thread).

        Raises:
            StoreFileUnwritable: a SQLite error of :data:`UNWRITABLE_CODES` (its message and code name;
                the store is then unwritable for :meth:`probe` until a write commits). docs/operating.md
                "Faults of a SQLite store".
        """
        changes = self.conn.total_changes
        try:
            value = fn(*args)
        except sqlite3.Error as exc:
            name = unwritable_name(exc)
            if name is None:
                raise
            message = f"{str(exc) or type(exc).__name__} ({name})"
            self._unwritable = (time.monotonic(), message)
            raise StoreFileUnwritable(message) from exc
        if self._unwritable is not None and self.conn.total_changes != changes and not self.conn.in_transaction:
            self._unwritable = None  # a write committed: the file takes writes again
        return value

    def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()

    def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        cur = self.conn.execute(sql, params)
        try:
            return int(cur.rowcount)
        finally:
            cur.close()

    def change_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        cur = self.conn.executemany(sql, rows)
        try:
            return int(cur.rowcount)
        finally:
            cur.close()

    def write(self, durable: bool, fn: Callable[[], _T]) -> _T:
        if durable:
            return fn()
        self.conn.execute("PRAGMA synchronous=NORMAL")
        try:
            return fn()
        finally:
            self.conn.execute("PRAGMA synchronous=FULL")

    def transaction(self, fn: Callable[[], _T]) -> _T:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            value = fn()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return value

    def interrupt_stuck(self) -> int:
        return 0

    def probe(self) -> None:
        """Whether the store can take a write now, known without writing: a read answers, and no call
        failed with one of :data:`UNWRITABLE_CODES` in the last ``unwritable_s`` without a write
        committed since (a write that would fail shows only when tried; the dispatch, the reconciler
        every 5 s and the tenants' writes try, and the first that commits clears it).

        Raises:
            StoreFileUnwritable: the last such failure, while it holds. docs/operating.md "Faults of a
                SQLite store".
        """
        failed = self._unwritable
        if failed is not None and time.monotonic() - failed[0] < self.unwritable_s:
            raise StoreFileUnwritable(failed[1])
        self.conn.execute("SELECT 1").fetchall()

    def close(self) -> None:
        self.conn.close()


def lock_store(path: Path) -> int:
    """Own the store for this process: an exclusive lock on ``<store>.lock``,
    held until the process exits (or :func:`aip_crewai.plumbing.storage.release_lock`).
    A second host on the same store is refused before it serves, as a second
    sidecar is on its journal (a shared-database mode does not exist yet).

    Raises:
        StoreLocked: another host process holds the lock.
        InsecureStorePath: the lock file is a symlink, not a regular file, or not private.
        UnusableStore: the lock file cannot be created, opened or locked (a read-only file system, no
            permission), naming the file and the reason.
    """
    return acquire_lock(
        path,
        insecure=InsecureStorePath,
        unusable=UnusableStore,
        held=lambda lock_path: StoreLocked(
            f"the store {path} is already owned by another running host (lock {lock_path} is held); "
            "stop it first, or give this host its own store"
        ),
    )
