"""The journal's retention: which jobs it keeps, as functions over its connection (run on the journal's
worker thread by :class:`~.store.Journal`, inside its ``BEGIN IMMEDIATE`` transaction where they write).

- :func:`check_room`: the admission bounds (retained runs, the size bound), before a job is admitted.
- :func:`tombstone`: archiving a terminal job (``DELETE /jobs/{action_id}``): its row stays as a
  tombstone (the action id and its request hash stay taken), its output, events, task index and run
  state rows are deleted.
- :func:`insert_imported`: finished jobs migrated from a reference journal, with their events and
  task index rows.

The caller keeps its retained-run count: +1 per admitted or imported job, -1 per archived one.

Source: ARCHITECTURE.md §4 (admission, ``DELETE /jobs/{action_id}``), §5 (journal, limits); docs/operating.md
"Migrating from the reference sidecar".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence

from aip_crewai.sidecar.errors import JournalFull
from aip_crewai.sidecar.jobs.model import ArchiveOutcome, ImportedJob, JobStatus
from aip_crewai.sidecar.journal.files import fetch_rows
from aip_crewai.sidecar.journal.queries import INSERT_EVENTS, INSERT_TASK_RUNS
from aip_crewai.sidecar.tenancy import tenant_of

__all__ = ["check_room", "tombstone", "insert_imported"]


def check_room(retained: int, max_retained_runs: int, used_bytes: Callable[[], int], max_bytes: int) -> None:
    """Refuse an admission past the retained-run limit or the size bound (``used_bytes`` is read only when
    the run limit leaves room).

    Raises:
        JournalFull: either bound reached (the caller writes nothing).
    """
    if retained >= max_retained_runs:
        raise JournalFull(f"retained runs are at the limit ({max_retained_runs}); archive terminal jobs")
    if used_bytes() >= max_bytes:
        raise JournalFull(f"the journal reached its size bound ({max_bytes} bytes); archive terminal jobs")


def tombstone(conn: sqlite3.Connection, action_id: str, now: int) -> ArchiveOutcome:
    """Archive the terminal job ``action_id`` (in the caller's transaction); ``ARCHIVED`` when this call did.

    Returns:
        ``NOT_FOUND``, ``ALREADY_ARCHIVED``, ``NOT_TERMINAL`` (nothing written), or ``ARCHIVED``.
    """
    rows = fetch_rows(conn, "SELECT status, archived FROM jobs WHERE action_id = ?", (action_id,))
    if not rows:
        return ArchiveOutcome.NOT_FOUND
    status, archived = rows[0]
    if archived:
        return ArchiveOutcome.ALREADY_ARCHIVED
    if not JobStatus(status).terminal:
        return ArchiveOutcome.NOT_TERMINAL
    conn.execute(
        "UPDATE jobs SET archived = 1, output = NULL, updated_at = ? WHERE action_id = ? AND archived = 0",
        (now, action_id),
    )
    conn.execute("DELETE FROM events WHERE action_id = ?", (action_id,))
    conn.execute("DELETE FROM task_runs WHERE action_id = ?", (action_id,))
    conn.execute("DELETE FROM run_state WHERE action_id = ?", (action_id,))
    return ArchiveOutcome.ARCHIVED


def insert_imported(conn: sqlite3.Connection, jobs: Sequence[ImportedJob]) -> tuple[list[str], list[str], list[str]]:
    """Insert the reference journal's finished ``jobs`` (in the caller's transaction).

    A job whose action id is already in the journal is left as it is: with the same request hash it
    counts as present, with another as a conflict. The idempotency key is unknown to the reference
    journal and stored empty.

    Returns:
        ``(imported, present, conflicting)`` action ids.

    Raises:
        sqlite3.Error: the caller rolls back (nothing imported).
    """
    imported: list[str] = []
    present: list[str] = []
    conflicting: list[str] = []
    for job in jobs:
        found = fetch_rows(conn, "SELECT request_hash FROM jobs WHERE action_id = ?", (job.action_id,))
        if found:
            (present if found[0][0] == job.request_hash else conflicting).append(job.action_id)
            continue
        conn.execute(
            "INSERT INTO jobs (action_id, crew_id, operation, request_hash, idempotency_key, timeout_ms, "
            "status, event_count, output, error, created_at, updated_at, imported) "
            "VALUES (?, ?, ?, ?, '', NULL, ?, ?, ?, ?, ?, ?, 1)",
            (
                job.action_id,
                job.crew_id,
                job.operation,
                job.request_hash,
                job.status.value,
                len(job.events),
                job.output,
                job.error,
                job.created_at,
                job.created_at,
            ),
        )
        conn.executemany(INSERT_EVENTS, [(job.action_id, e.sequence, e.event, e.data) for e in job.events])
        conn.executemany(
            INSERT_TASK_RUNS,
            [(r.task_id, job.action_id, job.crew_id, r.result_index, tenant_of(job.action_id)) for r in job.task_runs],
        )
        imported.append(job.action_id)
    return imported, present, conflicting
