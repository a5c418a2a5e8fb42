"""The schema of a SQLite database as text, for the schema snapshots (tests/snapshots/*.sql).

:func:`dump` writes every table, index, view and trigger of ``sqlite_master`` (sorted by type and name, each
statement as SQLite stores it, trailing spaces dropped) and ``PRAGMA user_version`` and ``application_id`` as comments. The committed
snapshots are written by hand from it (``python -m kits.sqlite_schema <database>`` with ``tests`` on
``PYTHONPATH``), never by the test that compares them.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path


def dump(path: Path) -> str:
    """The schema of the SQLite database at ``path``, one statement per paragraph (see the module doc)."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name"
        ).fetchall()
        version = db.execute("PRAGMA user_version").fetchone()[0]
        application_id = db.execute("PRAGMA application_id").fetchone()[0]
    db.close()
    parts = [f"-- user_version = {version}\n-- application_id = {application_id}"]
    for kind, name, table, sql in rows:
        text = "\n".join(line.rstrip() for line in (sql or "").strip().splitlines())
        parts.append(f"-- {kind} {name} (on {table})\n{text};")
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(dump(Path(sys.argv[1])))
