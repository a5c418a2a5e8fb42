"""The host store's final schema against an independent snapshot (tests/snapshots/host_store.sql, committed
text, not derived from the migrations at test time): a fresh database migrated through every migration must
equal it, so a migration that changes the schema changes the snapshot in the same commit, on purpose
(docs/ARCHITECTURE.md §10). Regenerate with ``PYTHONPATH=tests python -m kits.sqlite_schema <host.db>``
after reviewing the change."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kits.sqlite_schema import dump

from aip_crewai.host.store.migrations import MIGRATIONS, migrate
from aip_crewai.host.store.store import Store
from aip_crewai.plumbing.storage import apply_migrations

SNAPSHOT = Path(__file__).resolve().parents[1] / "snapshots" / "host_store.sql"


async def test_a_fresh_store_has_the_snapshot_schema(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    await (await Store.open(tmp_path / "host.db")).close()
    assert dump(tmp_path / "host.db") == SNAPSHOT.read_text()


def test_migrating_one_version_at_a_time_reaches_the_snapshot_schema(tmp_path: Path) -> None:
    """A store left at every earlier version, migrated by code that knows one more migration each time."""
    path = tmp_path / "stepwise.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for number in range(1, len(MIGRATIONS) + 1):  # code that knows `number` migrations opens the store
            assert apply_migrations(conn, MIGRATIONS[:number], too_new=lambda *_: AssertionError()) == number
        assert migrate(conn) == len(MIGRATIONS)  # the store's own migrate finds nothing left to apply
    finally:
        conn.close()
    assert dump(path) == SNAPSHOT.read_text()
