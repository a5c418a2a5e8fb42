"""The PostgreSQL engine of the host store (``[host] store = "postgresql://..."``): connections, the
pool of the store's worker threads, and the session lock that keeps one process per ``host_id``.

Source: ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .migrations import migrate_postgres
from .records import StoreError, StoreLocked, UnusableStore

_T = TypeVar("_T")


def is_postgres_url(location: str | Path) -> bool:
    """Whether a ``[host] store`` value names a PostgreSQL database (``postgresql://`` or ``postgres://``)."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def _pg_connect(url: str, application_name: str, error: type[StoreError]) -> Any:
    """An autocommit psycopg connection to ``url``; ``error`` when psycopg is missing or the server
    cannot be reached (its first message line only: libpq never echoes a password, and the URL holds none)."""
    try:
        import psycopg
    except ImportError as exc:
        raise error("a PostgreSQL store needs psycopg: pip install 'aip-crewai[postgresql]'") from exc
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=10, application_name=application_name)
    except psycopg.Error as exc:
        first = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise error(f"cannot connect to the PostgreSQL store ({type(exc).__name__}: {first})") from exc


def connect_postgres(url: str) -> Any:
    """Open an autocommit psycopg connection to ``url`` and apply :data:`PG_MIGRATIONS` (on the worker).

    Raises:
        StoreError: psycopg is not installed, the server refused the connection, or its schema is newer.
    """
    conn = _pg_connect(url, "aip-crewai-host", StoreError)
    try:
        migrate_postgres(conn)
    except BaseException:
        conn.close()
        raise
    return conn


#: Seconds a store call waits for a free pooled connection (or for a new one) before it fails.
PG_POOL_TIMEOUT_S = 10.0


def open_postgres_pool(url: str, size: int) -> Any:
    """Apply :data:`PG_MIGRATIONS` on one connection (:func:`connect_postgres`, then closed), then open a
    ``psycopg_pool.ConnectionPool`` of ``size`` autocommit connections to ``url`` (all opened before this
    returns). A connection is checked out for the whole of one store method (:class:`PostgresDb`)
    and tried as it leaves the pool: one the server dropped is replaced, not handed out.

    Raises:
        StoreError: psycopg or psycopg_pool is missing, the server cannot be reached, or the schema is
            newer (the pool's connections not ready within :data:`PG_POOL_TIMEOUT_S`).
    """
    connect_postgres(url).close()
    try:
        from psycopg_pool import ConnectionPool, PoolTimeout
    except ImportError as exc:
        raise StoreError("a PostgreSQL store needs psycopg_pool: pip install 'aip-crewai[postgresql]'") from exc
    # check: a connection is tried (an empty query) as it leaves the pool, so one the server dropped
    # (a restart, an idle timeout) is replaced there instead of failing the store method that got it.
    # reconnect_timeout: a lost connection's replacement backs off (doubling) for at most this long, then
    # the next store method starts a fresh attempt: after a long outage no retry waits minutes.
    pool = ConnectionPool(
        url,
        min_size=size,
        max_size=size,
        open=False,
        timeout=PG_POOL_TIMEOUT_S,
        name="aip-crewai-host-store",
        check=ConnectionPool.check_connection,
        reconnect_timeout=PG_POOL_TIMEOUT_S,
        kwargs={"autocommit": True, "connect_timeout": 10, "application_name": "aip-crewai-host"},
    )
    try:
        pool.open(wait=True, timeout=PG_POOL_TIMEOUT_S)
    except PoolTimeout as exc:
        pool.close()
        raise StoreError(
            f"the PostgreSQL store's {size} pooled connections were not ready within {PG_POOL_TIMEOUT_S:g} s"
        ) from exc
    except BaseException:
        pool.close()
        raise
    return pool


#: The class of the session advisory locks that keep one process per host id on a PostgreSQL store.
PG_HOST_ID_LOCK_CLASS = 0x41495045


class PostgresHostLock:
    """This process's claim on ``host_id`` on a PostgreSQL store: a connection holding a session advisory
    lock on it (released when the connection closes, so also when the process dies). Several hosts share
    one store, each under its own id: two processes with one id would share dispatch leases.

    A database restart ends the session and with it the lock, silently: :meth:`verify` (called
    periodically by the host) notices, reconnects and takes the lock again, and says when another
    process took the id in the meantime (the host then stops: it must not dispatch under a shared id).

    Raises (constructor):
        StoreLocked: another running process uses ``host_id`` on this store.
        UnusableStore: psycopg is missing or the server cannot be reached.
    """

    def __init__(self, url: str, host_id: str) -> None:
        self.url, self.host_id = url, host_id
        conn = self._take()
        if conn is None:
            raise StoreLocked(
                f"another running host uses host_id {host_id!r} on this PostgreSQL store; "
                "give each host its own [host] host_id"
            )
        self.conn: Any = conn

    def _take(self) -> Any | None:
        """A new connection holding the lock, or None when another process holds it (UnusableStore: no server)."""
        conn = _pg_connect(self.url, "aip-crewai-host-lock", UnusableStore)
        try:
            row = conn.execute(
                "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (PG_HOST_ID_LOCK_CLASS, self.host_id)
            ).fetchone()
        except BaseException:
            conn.close()
            raise
        if not row or not row[0]:
            conn.close()
            return None
        return conn

    def verify(self) -> bool | None:
        """Blocking (run it on a thread). True: this process holds the lock (its connection answers, or it
        broke and the lock was taken again on a new one). False: the connection broke and another process
        holds the id now. None: the server cannot be reached (unknown; try again later). Never raises."""
        import psycopg

        try:
            self.conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            pass
        try:
            self.conn.close()
        except psycopg.Error:
            pass
        try:
            conn = self._take()
        except (StoreError, psycopg.Error):
            return None
        if conn is None:
            return False
        self.conn = conn
        return True

    def close(self) -> None:
        """Release the lock (close its connection)."""
        self.conn.close()


#: The advisory lock every PostgreSQL write transaction of the host store takes (an arbitrary constant).
WRITER_LOCK = 0x41495043  # "AIPC"


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

    Source: ARCHITECTURE.md §10 (a PostgreSQL store: one pooled connection per store thread).
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
