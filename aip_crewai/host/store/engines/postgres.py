"""The PostgreSQL engine of the host store (``[host] store = "postgresql://..."``): connections, the
pool of the store's worker threads, and the session lock that keeps one process per ``host_id``.

Source: ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..migrations import migrate_postgres
from ..records import StoreError, StoreLocked, UnusableStore

_T = TypeVar("_T")


def is_postgres_url(location: str | Path) -> bool:
    """Whether a ``[host] store`` value names a PostgreSQL database (``postgresql://`` or ``postgres://``)."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


#: Default ``[host] store_statement_timeout_ms``, ``store_lock_timeout_ms`` and
#: ``store_idle_in_transaction_timeout_ms`` (docs/operating.md "Faults and their bounds").
DEFAULT_STATEMENT_TIMEOUT_MS, DEFAULT_LOCK_TIMEOUT_MS, DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS = 4_000, 2_000, 4_000
#: What a store call may take beyond the statement timeout before the host gives up on it, ms (the
#: round trip of the server's own cancellation, the commit).
CALL_MARGIN_MS = 1_000
#: TCP keepalives of every connection to the store: first probe after this many idle seconds, then one
#: every interval, the connection declared dead after ``count`` unanswered ones (libpq parameters).
KEEPALIVES_IDLE_S, KEEPALIVES_INTERVAL_S, KEEPALIVES_COUNT = 5, 2, 3


@dataclass(frozen=True)
class StoreTimeouts:
    """The bounds of every PostgreSQL session of the host store, ms (``[host] store_*_timeout_ms``).

    ``statement_ms``, ``lock_ms`` and ``idle_in_transaction_ms`` are set on each session
    (``statement_timeout``, ``lock_timeout``, ``idle_in_transaction_session_timeout``): the server ends
    a statement, a lock wait (the writer lock included) or an abandoned transaction past them.
    :attr:`call_ms` bounds one whole store call as its caller sees it (the wait for a pooled connection
    included); the host enforces it itself, so a server that does not answer at all (stopped, or its
    network gone) still cannot hold a request longer.

    Source: docs/operating.md "Faults and their bounds"; ARCHITECTURE.md §10.
    """

    statement_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS
    lock_ms: int = DEFAULT_LOCK_TIMEOUT_MS
    idle_in_transaction_ms: int = DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS

    @property
    def call_ms(self) -> int:
        """The bound of one store call, ms: the statement timeout plus :data:`CALL_MARGIN_MS`."""
        return self.statement_ms + CALL_MARGIN_MS

    def connect_kwargs(self, url: str, application_name: str) -> dict[str, Any]:
        """libpq parameters of every connection to the store: these session timeouts (added to any
        ``options`` the URL carries), TCP keepalives and ``tcp_user_timeout``, a connect timeout of
        the call bound (whole seconds, at least 2: libpq's floor), autocommit. Pure."""
        from psycopg.conninfo import conninfo_to_dict

        given = conninfo_to_dict(url).get("options")
        settings = (
            f"-c statement_timeout={self.statement_ms} -c lock_timeout={self.lock_ms} "
            f"-c idle_in_transaction_session_timeout={self.idle_in_transaction_ms}"
        )
        return {
            "autocommit": True,
            "application_name": application_name,
            "connect_timeout": max(2, math.ceil(self.call_ms / 1000)),
            "options": f"{given} {settings}" if given else settings,
            "keepalives": 1,
            "keepalives_idle": KEEPALIVES_IDLE_S,
            "keepalives_interval": KEEPALIVES_INTERVAL_S,
            "keepalives_count": KEEPALIVES_COUNT,
            "tcp_user_timeout": KEEPALIVES_IDLE_S * 1000 + KEEPALIVES_INTERVAL_S * KEEPALIVES_COUNT * 1000,
        }


def interrupt_connection(conn: Any) -> None:
    """Make a call blocked on ``conn`` fail at once: shut its socket down (both ways) from any thread. The
    blocked thread then gets ``OperationalError`` (the connection is lost) and the pool discards it; the
    descriptor itself stays open until the connection is closed, so nothing else can reuse it meanwhile.
    Never raises (a connection already closed has nothing to interrupt)."""
    try:
        fd = conn.pgconn.socket
        with socket.socket(fileno=os.dup(fd)) as dup:
            dup.shutdown(socket.SHUT_RDWR)
    except Exception:  # closed, or no socket (yet): nothing to interrupt
        pass


class CallGuard:
    """The connections the store's calls are using now, with the time each call began (monotonic
    seconds): :meth:`interrupt_older_than` ends those past the call bound (:func:`interrupt_connection`).
    Thread-safe: the worker threads enter and leave, the event loop interrupts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[Any, float]] = {}
        self._local = threading.local()

    def begin(self) -> None:
        """A call begins on this thread (before it waits for a connection)."""
        self._local.started = time.monotonic()

    def enter(self, conn: Any) -> None:
        """This thread's call uses ``conn`` now (the pool's check of a connection included)."""
        started = getattr(self._local, "started", None) or time.monotonic()
        with self._lock:
            self._calls[threading.get_ident()] = (conn, started)

    def leave(self) -> None:
        with self._lock:
            self._calls.pop(threading.get_ident(), None)

    def interrupt_older_than(self, seconds: float) -> int:
        """Interrupt every call running for at least ``seconds``; returns how many."""
        now = time.monotonic()
        with self._lock:
            stuck = [conn for conn, started in self._calls.values() if now - started >= seconds]
        for conn in stuck:
            interrupt_connection(conn)
        return len(stuck)


def _pg_connect(url: str, application_name: str, error: type[StoreError], timeouts: StoreTimeouts | None = None) -> Any:
    """An autocommit psycopg connection to ``url`` with the session bounds of ``timeouts``
    (:meth:`StoreTimeouts.connect_kwargs`); ``error`` when psycopg is missing or the server
    cannot be reached (its first message line only: libpq never echoes a password, and the URL holds none)."""
    try:
        import psycopg
    except ImportError as exc:
        raise error("a PostgreSQL store needs psycopg: pip install 'aip-crewai[postgresql]'") from exc
    try:
        return psycopg.connect(url, **(timeouts or StoreTimeouts()).connect_kwargs(url, application_name))
    except psycopg.Error as exc:
        first = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise error(f"cannot connect to the PostgreSQL store ({type(exc).__name__}: {first})") from exc


def connect_postgres(url: str, timeouts: StoreTimeouts | None = None) -> Any:
    """Open an autocommit psycopg connection to ``url`` and apply :data:`PG_MIGRATIONS` (on the worker).
    The migration runs without the statement timeout (a large table's index may take longer).

    Raises:
        StoreError: psycopg is not installed, the server refused the connection, or its schema is newer.
    """
    conn = _pg_connect(url, "aip-crewai-host", StoreError, timeouts)
    conn.execute("SET statement_timeout = 0")
    try:
        migrate_postgres(conn)
    except BaseException:
        conn.close()
        raise
    return conn


#: Seconds the store's pool waits for its connections when it opens.
PG_POOL_TIMEOUT_S = 10.0


def open_postgres_pool(
    url: str, size: int, timeouts: StoreTimeouts | None = None, guard: CallGuard | None = None
) -> Any:
    """Apply :data:`PG_MIGRATIONS` on one connection (:func:`connect_postgres`, then closed), then open a
    ``psycopg_pool.ConnectionPool`` of ``size`` autocommit connections to ``url`` (all opened before this
    returns). A connection is checked out for the whole of one store method (:class:`PostgresDb`)
    and tried as it leaves the pool: one the server dropped is replaced, not handed out. Every
    connection carries the session bounds of ``timeouts``; a call waits at most its call bound for a
    free connection (``PoolTimeout``); ``guard`` sees the check of a connection leaving the pool as
    part of the call (a server that does not answer the check is interrupted like a stuck call).

    Raises:
        StoreError: psycopg or psycopg_pool is missing, the server cannot be reached, or the schema is
            newer (the pool's connections not ready within :data:`PG_POOL_TIMEOUT_S`).
    """
    timeouts = timeouts or StoreTimeouts()
    connect_postgres(url, timeouts).close()
    try:
        from psycopg_pool import ConnectionPool, PoolTimeout
    except ImportError as exc:
        raise StoreError("a PostgreSQL store needs psycopg_pool: pip install 'aip-crewai[postgresql]'") from exc

    # check: a connection is tried (an empty query) as it leaves the pool, so one the server dropped
    # (a restart, an idle timeout) is replaced there instead of failing the store method that got it.
    # reconnect_timeout: a lost connection's replacement backs off (doubling) for at most this long, then
    # the next store method starts a fresh attempt: after a long outage no retry waits minutes.
    def check(conn: Any) -> None:
        if guard is not None:
            guard.enter(conn)
        ConnectionPool.check_connection(conn)

    pool = ConnectionPool(
        url,
        min_size=size,
        max_size=size,
        open=False,
        timeout=timeouts.call_ms / 1000,
        name="aip-crewai-host-store",
        check=check,
        reconnect_timeout=PG_POOL_TIMEOUT_S,
        kwargs=timeouts.connect_kwargs(url, "aip-crewai-host"),
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

    def __init__(self, url: str, host_id: str, timeouts: StoreTimeouts | None = None) -> None:
        self.url, self.host_id, self.timeouts = url, host_id, timeouts
        conn = self._take()
        if conn is None:
            raise StoreLocked(
                f"another running host uses host_id {host_id!r} on this PostgreSQL store; "
                "give each host its own [host] host_id"
            )
        self.conn: Any = conn

    def _take(self) -> Any | None:
        """A new connection holding the lock, or None when another process holds it (UnusableStore: no server)."""
        conn = _pg_connect(self.url, "aip-crewai-host-lock", UnusableStore, self.timeouts)
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
#: How long a writer holding :data:`WRITER_LOCK` waits for any other lock (a row or a table), ms, at most
#: (the lock timeout when it is shorter). Every write of the store's own sessions takes the writer lock
#: first, so such a wait is always on a session outside the store's writers (an operator's open
#: transaction in psql, a ``VACUUM FULL``): the writer gives up soon, failing only the write that needs
#: that lock, instead of holding the writer lock for the whole lock timeout while every other writer, of
#: every tenant and host, queues behind it past its own (docs/operating.md "Faults and their bounds").
OUTSIDE_LOCK_WAIT_MS = 100


_PLACEHOLDER = re.compile(r"%|\?")
#: The database's clock in the store's SQL, epoch ms (``DB_NOW``): on PostgreSQL the server's ``now()``
#: (the transaction's start), never a host's; SQLite (one host) registers it as the store's clock.
DB_NOW = "db_now_ms()"
PG_NOW = "CAST(EXTRACT(EPOCH FROM now()) * 1000 AS BIGINT)"


def postgres_sql(sql: str) -> str:
    """``?`` placeholders → ``%s``, a literal ``%`` → ``%%`` (psycopg's format), and :data:`DB_NOW` →
    the server's clock. Our SQL never holds a ``?`` inside a string literal (a test checks every
    statement the store runs)."""
    return _PLACEHOLDER.sub(lambda match: "%s" if match.group() == "?" else "%%", sql).replace(DB_NOW, PG_NOW)


class PostgresDb:
    """PostgreSQL through a pool of synchronous psycopg 3 connections (autocommit), one per store thread.

    The store runs each method on one of its worker threads (as many as the pool holds connections)
    through :meth:`run`, which checks a connection out of the pool for the whole method and binds it to
    that thread; the other methods use the bound connection. A connection that broke (the server
    restarted) is discarded by the pool when it is returned, and a new one is opened in its place.
    Reads of several callers thereby run in parallel; every write runs in a transaction holding
    :data:`WRITER_LOCK` (``pg_advisory_xact_lock``), so the writers of all hosts and threads on the
    database serialize like SQLite's single writer; once it holds it, a writer waits for any other lock
    at most :data:`OUTSIDE_LOCK_WAIT_MS`.

    Source: ARCHITECTURE.md §10 (a PostgreSQL store: one pooled connection per store thread).
    """

    engine = "postgresql"

    def __init__(self, pool: Any, timeouts: StoreTimeouts | None = None, guard: CallGuard | None = None) -> None:
        import psycopg

        #: The ``psycopg_pool.ConnectionPool`` the connections come from (opened by the caller).
        self.pool = pool
        from psycopg_pool import PoolTimeout

        self.integrity_error: type[Exception] = psycopg.errors.IntegrityError
        #: Every class of "the database cannot serve this now": connection refused or lost, a statement,
        #: lock wait or idle transaction past its timeout, a serialization failure or deadlock, too many
        #: connections (all ``OperationalError``); a read-only database (a standby after a failover,
        #: ``default_transaction_read_only``); no pooled connection free within the call bound.
        self.unavailable_errors: tuple[type[BaseException], ...] = (
            psycopg.OperationalError,
            psycopg.errors.ReadOnlySqlTransaction,
            psycopg.errors.IdleInTransactionSessionTimeout,
            PoolTimeout,
        )
        self.timeouts = timeouts or StoreTimeouts()
        #: The bound of one call, seconds (the store gives up on a call past it: :meth:`interrupt_stuck`).
        self.call_timeout_s: float | None = self.timeouts.call_ms / 1000
        self.guard = guard or CallGuard()
        outside_ms = min(self.timeouts.lock_ms, OUTSIDE_LOCK_WAIT_MS)
        self._writer_sql = f"SELECT pg_advisory_xact_lock({WRITER_LOCK}); SET LOCAL lock_timeout = {outside_ms}"
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
        self.guard.begin()
        try:
            with self.pool.connection() as conn:
                self.guard.enter(conn)
                self._bound.conn, self._bound.depth = conn, 0
                try:
                    return fn(*args)
                finally:
                    self._bound.conn = None
        finally:
            self.guard.leave()

    def interrupt_stuck(self) -> int:
        """End every call running past the call bound (the server does not answer: stopped, or its
        network gone); their threads fail at once and their connections are replaced. Returns how many."""
        return self.guard.interrupt_older_than(self.timeouts.call_ms / 1000)

    def probe(self) -> None:
        """Whether the store can take a write now: a writer transaction (the writer lock within the lock
        timeout) on a database that is not read-only, whose ``actions`` table no outside session holds
        locked. Raises one of :attr:`unavailable_errors`."""
        import psycopg

        def check() -> None:
            row = self.conn.execute("SELECT current_setting('transaction_read_only')").fetchone()
            if row and row[0] == "on":
                raise psycopg.errors.ReadOnlySqlTransaction("the database is read-only (a standby?)")
            # A table lock held outside (VACUUM FULL, LOCK TABLE) blocks every action's read and write: this
            # read waits for it at most OUTSIDE_LOCK_WAIT_MS, then the store is unready (a row lock does not
            # block it: one action's lock leaves the others served).
            self.conn.execute("SELECT 1 FROM actions LIMIT 1")

        self.transaction(check)

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
                # One round trip, in order (the simple query protocol: no parameters): the writer lock
                # under the session's lock timeout, then the short bound for every lock after it.
                conn.execute(self._writer_sql)
                return fn()
        finally:
            bound.depth -= 1

    def close(self) -> None:
        self.pool.close()
