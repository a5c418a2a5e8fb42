"""The sidecar journal's final schema against an independent snapshot (tests/snapshots/sidecar_journal.sql,
committed text, not derived from the migrations at test time): a fresh journal migrated through every migration,
and one migrated a version at a time, must equal it (docs/ARCHITECTURE.md §10). Regenerate with
``PYTHONPATH=tests python -m kits.sqlite_schema <journal.db>`` after reviewing the change."""

from __future__ import annotations

from pathlib import Path

import pytest
from kits.sqlite_schema import dump

from aip_crewai.sidecar.journal import files as journal_files
from aip_crewai.sidecar.journal.store import SCHEMA_VERSION, Journal

SNAPSHOT = Path(__file__).resolve().parents[1] / "snapshots" / "sidecar_journal.sql"


async def test_a_fresh_journal_has_the_snapshot_schema(tmp_path: Path) -> None:
    await (await Journal.open(tmp_path / "journal.db")).close()
    assert dump(tmp_path / "journal.db") == SNAPSHOT.read_text()


async def test_migrating_one_version_at_a_time_reaches_the_snapshot_schema(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "stepwise.db"
    for number in range(1, SCHEMA_VERSION + 1):  # code that knows `number` migrations opens the journal
        monkeypatch.setattr(journal_files, "SCHEMA_VERSION", number)
        await (await Journal.open(path)).close()
    monkeypatch.undo()
    assert dump(path) == SNAPSHOT.read_text()
