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
| outages (``StoreUnavailable``) | a full disk, an I/O error, a read-only file, a write lock held outside (``sqlite.UNWRITABLE_CODES``) | lost or refused connections, timeouts, a read-only database, no pooled connection |

Serializing writers keeps every multi-statement method (the key's holder
check and the insert, a decision and its action's start) atomic across
hosts exactly as it is for one SQLite writer (every fence
holds across replicas); reads run without the lock.

Source: ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")


class Db(Protocol):
    """What the store's worker-thread functions use of a database connection."""

    #: The engine's integrity-constraint error class (a unique or foreign key violated).
    integrity_error: type[Exception]
    #: ``sqlite`` or ``postgresql``.
    engine: str
    #: The engine's errors that mean "cannot reach the database now" (the store raises StoreUnavailable).
    unavailable_errors: tuple[type[BaseException], ...]
    #: The bound of one store call, seconds (None: none; the store raises StoreUnavailable past it).
    call_timeout_s: float | None

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

    def interrupt_stuck(self) -> int:
        """End the calls running past :attr:`call_timeout_s` (from the event loop); returns how many."""

    def probe(self) -> None:
        """Check that the database can take a write now (:meth:`Store.probe`); raises one of
        :attr:`unavailable_errors` when it cannot."""

    def close(self) -> None:
        """Close the connection."""
