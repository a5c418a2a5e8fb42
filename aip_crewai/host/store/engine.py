"""The two database engines under the host store, behind one small synchronous interface.

:class:`~aip_crewai.host.store.store.Store` writes its SQL once, with ``?``
placeholders, and runs every method's statements as one function on its
worker thread (one hop per method). That function talks to a :class:`Db`:

| | :class:`SqliteDb` (the embedded default) | :class:`PostgresDb` (``postgresql://...``) |
|---|---|---|
| driver | ``sqlite3`` | psycopg 3 (synchronous connections, autocommit) |
| connections | one, on the store's one worker thread | a ``psycopg_pool`` pool, one connection per worker thread (``[host] store_pool_size``) |
| placeholders | ``?`` | ``?`` rewritten to ``%s`` (a literal ``%`` doubled) |
| a write transaction | ``BEGIN IMMEDIATE`` (the database's one writer) | ``BEGIN`` + ``pg_advisory_xact_lock``: writers of every host serialize as SQLite's do |
| a write outside a transaction | one statement, autocommit | wrapped in the same locked transaction |
| ``durable=False`` | ``PRAGMA synchronous=NORMAL`` | ``SET LOCAL synchronous_commit = off`` |
| integrity errors | ``sqlite3.IntegrityError`` | ``psycopg.errors.IntegrityError`` |

Serializing writers keeps every multi-statement method (the key's holder
check and the insert, a decision and its action's start) atomic across
hosts exactly as it is for one SQLite writer (issue 21 item 2: every fence
holds across replicas); reads run without the lock.

Source: ARCHITECTURE.md §10 (storage); issue 21.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")

#: The advisory lock every PostgreSQL write transaction of the host store takes (an arbitrary constant).
WRITER_LOCK = 0x41495043  # "AIPC"


class Db(Protocol):
    """What the store's worker-thread functions use of a database connection."""

    #: The engine's integrity-constraint error class (a unique or foreign key violated).
    integrity_error: type[Exception]
    #: ``sqlite`` or ``postgresql``.
    engine: str
    #: The engine's errors that mean "cannot reach the database now" (the store raises StoreUnavailable).
    unavailable_errors: tuple[type[BaseException], ...]

    def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run one store method's function ``fn(*args)`` on the calling worker thread, with a connection
        for its whole duration (every statement of one method on one connection)."""

    def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one statement (``[]`` for a statement that returns none)."""

    def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Rows changed by one statement."""

    def change_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        """Rows changed by one statement run once per parameter row."""

    def write(self, durable: bool, fn: Callable[[], _T]) -> _T:
        """Run the write ``fn`` (several statements allowed); ``durable``: fsynced at commit."""

    def transaction(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` as one transaction that excludes every other writer; roll back on any error."""

    def close(self) -> None:
        """Close the connection."""


class SqliteDb:
    """The embedded engine: one ``sqlite3`` connection (WAL, autocommit) owned by the worker thread."""

    integrity_error: type[Exception] = sqlite3.IntegrityError
    engine = "sqlite"
    unavailable_errors: tuple[type[BaseException], ...] = ()  # a local file: its errors are not outages

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return fn(*args)  # one connection, one worker thread

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

    def close(self) -> None:
        self.conn.close()


_PLACEHOLDER = re.compile(r"%|\?")


def postgres_sql(sql: str) -> str:
    """``?`` placeholders → ``%s`` and a literal ``%`` → ``%%`` (psycopg's format). Our SQL never
    holds a ``?`` inside a string literal (a test checks every statement the store runs)."""
    return _PLACEHOLDER.sub(lambda match: "%s" if match.group() == "?" else "%%", sql)


class PostgresDb:
    """PostgreSQL through a pool of synchronous psycopg 3 connections (autocommit), one per store thread.

    The store runs each method on one of its worker threads (as many as the pool holds connections)
    through :meth:`run`, which checks a connection out of the pool for the whole method and binds it to
    that thread; the other methods use the bound connection. A connection that broke (the server
    restarted) is discarded by the pool when it is returned, and a new one is opened in its place.
    Reads of several callers thereby run in parallel; every write runs in a transaction holding
    :data:`WRITER_LOCK` (``pg_advisory_xact_lock``), so the writers of all hosts and threads on the
    database serialize like SQLite's single writer.

    Source: issue 21 item 1 (a connection pool).
    """

    engine = "postgresql"

    def __init__(self, pool: Any) -> None:
        import psycopg

        #: The ``psycopg_pool.ConnectionPool`` the connections come from (opened by the caller).
        self.pool = pool
        from psycopg_pool import PoolTimeout

        self.integrity_error: type[Exception] = psycopg.errors.IntegrityError
        #: Connection refused or lost (``OperationalError``), or no pooled connection free in time.
        self.unavailable_errors: tuple[type[BaseException], ...] = (psycopg.OperationalError, PoolTimeout)
        self._bound = threading.local()
        self._cache: dict[str, str] = {}

    @property
    def conn(self) -> Any:
        """The connection bound to this thread by :meth:`run`.

        Raises:
            RuntimeError: called outside :meth:`run` (a store bug).
        """
        conn = getattr(self._bound, "conn", None)
        if conn is None:
            raise RuntimeError("a PostgreSQL store statement ran outside Db.run")
        return conn

    def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if getattr(self._bound, "conn", None) is not None:  # a method calling another on the same thread
            return fn(*args)
        with self.pool.connection() as conn:
            self._bound.conn, self._bound.depth = conn, 0
            try:
                return fn(*args)
            finally:
                self._bound.conn = None

    def _sql(self, sql: str) -> str:
        converted = self._cache.get(sql)
        if converted is None:
            converted = self._cache[sql] = postgres_sql(sql)
        return converted

    def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self.conn.execute(self._sql(sql), tuple(params))
        return list(cur.fetchall()) if cur.description is not None else []

    def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        return int(self.conn.execute(self._sql(sql), tuple(params)).rowcount)

    def change_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        changed = 0
        with self.conn.cursor() as cur:
            for row in rows:  # rowcount of executemany is the last statement's only
                cur.execute(self._sql(sql), tuple(row))
                changed += max(cur.rowcount, 0)
        return changed

    def write(self, durable: bool, fn: Callable[[], _T]) -> _T:
        def locked() -> _T:
            if not durable:
                self.conn.execute("SET LOCAL synchronous_commit = off")
            return fn()

        return self.transaction(locked)

    def transaction(self, fn: Callable[[], _T]) -> _T:
        conn, bound = self.conn, self._bound
        if bound.depth:  # already inside this connection's transaction (a write calling a transaction)
            return fn()
        bound.depth += 1
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))
                return fn()
        finally:
            bound.depth -= 1

    def close(self) -> None:
        self.pool.close()
