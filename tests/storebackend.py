"""Which store the host processes of the integration and reliability suites use.

``AIP_CREWAI_TEST_STORE=postgresql`` (default ``sqlite``) gives every host those suites start
(``kits.host.write_config`` and ``relkit`` without an explicit ``store``) ``[host] store =
"postgresql://..."``: a fresh database per host identity (its working directory) on the session's
throwaway cluster (:mod:`pgserver`), and a stable ``[host] host_id``, so a restart of the same host (same
working directory) finds its state and its own dispatch leases. Without PostgreSQL installed, a test
that starts a host under the switch is skipped with one line.

Read the store of a host through :func:`open_host_store` or :func:`read_host_store` (the product's
:class:`~aip_crewai.host.store.store.Store`, either backend) or :func:`store_text` (every stored value, to look
for what must not be there). A test about the SQLite file itself (its modes, a non-SQLite file) passes
``store=SQLITE_STORE`` explicitly and runs the same under either backend.

``make chaos`` starts its hosts through these helpers too (the switch works there as well); the cluster
is stopped by the test session's fixture, or at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pgserver
import pytest

_T = TypeVar("_T")

#: The environment variable that picks the backend of the suites' hosts.
SWITCH = "AIP_CREWAI_TEST_STORE"
BACKENDS = ("sqlite", "postgresql")
#: The SQLite store of a host, relative to its working directory (``[host] store``'s default in the suites).
SQLITE_STORE = "host.db"


class Unavailable(Exception):
    """PostgreSQL was asked for but cannot run here (no binaries or no psycopg); the text says why."""


def backend() -> str:
    """``sqlite`` or ``postgresql``: the value of :data:`SWITCH` (ValueError on anything else)."""
    value = os.environ.get(SWITCH, "sqlite").strip().lower() or "sqlite"
    if value not in BACKENDS:
        raise ValueError(f"{SWITCH}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def postgresql() -> bool:
    """Whether the suites' hosts run on PostgreSQL (``AIP_CREWAI_TEST_STORE=postgresql``)."""
    return backend() == "postgresql"


#: For a process test whose hosts are on PostgreSQL whatever the switch says: it runs once, in the PostgreSQL
#: pass (``make test-postgresql``), not also in ``make test`` (which stays within its time).
only_in_postgresql_pass = pytest.mark.skipif(
    not postgresql(), reason="runs in make test-postgresql (AIP_CREWAI_TEST_STORE=postgresql)"
)


_cluster: pgserver.PostgresServer | None = None
_databases: dict[Path, tuple[str, str]] = {}
_numbers = itertools.count(1)


def cluster() -> pgserver.PostgresServer:
    """The process's throwaway PostgreSQL cluster, started on first use (the ``postgres_server`` fixture
    shares it). Raises :class:`Unavailable` when PostgreSQL or psycopg is missing."""
    global _cluster
    if _cluster is None:
        bin_dir = pgserver.find_bin_dir()
        if bin_dir is None:
            raise Unavailable(pgserver.SKIP_REASON)
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise Unavailable(
                "PostgreSQL tests skipped: psycopg is not installed (pip install 'psycopg[binary]')"
            ) from None
        _cluster = pgserver.PostgresServer(bin_dir)
        atexit.register(stop_cluster)
    return _cluster


def stop_cluster() -> None:
    """Stop the cluster if one was started (idempotent); its databases are forgotten."""
    global _cluster
    server, _cluster = _cluster, None
    _databases.clear()
    if server is not None:
        server.stop()


def _skip(reason: str) -> None:
    import pytest

    pytest.skip(reason)


def host_store(workdir: Path) -> tuple[str, str | None]:
    """``(store, host_id)`` for a host working in ``workdir``: ``("host.db", None)`` on SQLite; on
    PostgreSQL the URL of this working directory's own database (created on first use, reused by a
    restart) and a host id stable across restarts. Under the switch without PostgreSQL the calling test
    is skipped."""
    if not postgresql():
        return SQLITE_STORE, None
    key = workdir.resolve()
    if key not in _databases:
        try:
            server = cluster()
        except Unavailable as exc:
            _skip(f"{SWITCH}=postgresql: {exc}")
            raise
        number = next(_numbers)
        _databases[key] = (server.create_database(f"host_{os.getpid()}_{number}"), f"test-host-{number}")
    return _databases[key]


def store_location(workdir: Path) -> Path | str:
    """What ``Store.open`` takes for the store of the host working in ``workdir`` (a path or a URL)."""
    store, _ = host_store(workdir)
    return store if store.startswith("postgresql://") else workdir / store


async def open_host_store(workdir: Path) -> Any:
    """The store of the host working in ``workdir`` (either backend), opened through the product's
    :meth:`~aip_crewai.host.store.store.Store.open`; close it when done. Read it beside the running host."""
    from aip_crewai.host.store.store import Store

    return await Store.open(store_location(workdir))


def read_host_store(workdir: Path, read: Callable[[Any], Awaitable[_T]]) -> _T:
    """``await read(store)`` on the store of the host working in ``workdir`` (:func:`open_host_store`),
    from synchronous code; the store is closed afterwards. Read-only use beside the running host."""

    async def run() -> _T:
        store = await open_host_store(workdir)
        try:
            return await read(store)
        finally:
            await store.close()

    return asyncio.run(run())


def store_text(workdir: Path) -> bytes:
    """Every byte a host working in ``workdir`` stored: the SQLite file and its WAL, or on PostgreSQL
    every row of every table of its database as text (to scan for secrets that must not be there)."""
    location = store_location(workdir)
    if isinstance(location, Path):
        return b"".join(p.read_bytes() for p in (location, Path(f"{location}-wal")) if p.exists())
    import psycopg

    with psycopg.connect(location, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() "
                "AND table_type = 'BASE TABLE' ORDER BY table_name"
            ).fetchall()
        ]
        return b"\n".join(
            str(row[0]).encode()
            for table in tables
            for row in conn.execute(f'SELECT t::text FROM "{table}" AS t').fetchall()
        )
