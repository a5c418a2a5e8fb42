"""The journal's reads as functions over its connection (run on the journal's worker thread by
:class:`~.store.Journal`): the job row, a job's summary and event pages, and the retained run a
replay starts from. The SQL text of the jobs row is written once here.

Source: ARCHITECTURE.md §4 (job views, event pages), §5 (replay storage), §10.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

import msgspec

from aip_crewai.sidecar.jobs.model import EventRow, JobRecord, JobStatus
from aip_crewai.sidecar.journal.files import fetch_rows

__all__ = [
    "JOB_COLUMNS",
    "GET_JOB",
    "INSERT_EVENTS",
    "INSERT_TASK_RUNS",
    "JOBS_ENDING",
    "TASK_RUN_HIT",
    "job_record",
    "read_summary",
    "read_events",
    "read_summary_and_events",
    "task_run_hit",
]

JOB_COLUMNS = (
    "action_id, crew_id, operation, request_hash, idempotency_key, timeout_ms, status, event_count, output, "
    "error, dropped_events, provider_stop_observed, archived, created_at, updated_at, imported"
)
GET_JOB = f"SELECT {JOB_COLUMNS} FROM jobs WHERE action_id = ?"
INSERT_EVENTS = "INSERT INTO events VALUES (?, ?, ?, ?)"
#: A completed run's task index rows: ``(task_id, action_id, crew_id, result_index, tenant)``.
INSERT_TASK_RUNS = (
    "INSERT OR IGNORE INTO task_runs (task_id, action_id, crew_id, result_index, tenant) VALUES (?,?,?,?,?)"
)
#: Job ids ending in ``:<action id>``, of any tenant (a full scan, for the operator's CLI).
JOBS_ENDING = (
    "SELECT action_id FROM jobs WHERE length(action_id) > ? AND "
    "substr(action_id, length(action_id) - ? + 1) = ? ORDER BY action_id LIMIT ?"
)
#: The latest retained completed run of (tenant, crew) holding a task id, with its run state: rows for
#: :func:`task_run_hit`; parameters (task id, tenant, crew id).
TASK_RUN_HIT = (
    "SELECT j.output, t.result_index, s.state, t.action_id FROM task_runs t JOIN jobs j ON j.action_id = t.action_id "
    "LEFT JOIN run_state s ON s.action_id = t.action_id AND s.result_index = COALESCE(t.result_index, -1) "
    "WHERE t.task_id = ? AND t.tenant = ? AND t.crew_id = ? AND j.archived = 0 AND j.status = 'completed' "
    "ORDER BY t.rowid DESC LIMIT 1"
)


def job_record(row: Sequence[Any]) -> JobRecord:
    """A :class:`JobRecord` from a row of :data:`JOB_COLUMNS` (times in epoch ms)."""
    return JobRecord(
        action_id=row[0],
        crew_id=row[1],
        operation=row[2],
        request_hash=row[3],
        idempotency_key=row[4],
        timeout_ms=row[5],
        status=JobStatus(row[6]),
        event_count=row[7],
        output=row[8],
        error=row[9],
        dropped_events=row[10],
        provider_stop_observed=None if row[11] is None else bool(row[11]),
        archived=bool(row[12]),
        created_at=row[13],
        updated_at=row[14],
        imported=bool(row[15]),
    )


def read_summary(conn: sqlite3.Connection, action_id: str) -> tuple[JobStatus, int, bool] | None:
    """``(status, event_count, archived)`` of a job without its output and error blobs, or None."""
    rows = fetch_rows(conn, "SELECT status, event_count, archived FROM jobs WHERE action_id = ?", (action_id,))
    return (JobStatus(rows[0][0]), rows[0][1], bool(rows[0][2])) if rows else None


def read_events(
    conn: sqlite3.Connection, action_id: str, cursor: int, limit: int, max_bytes: int | None
) -> list[EventRow]:
    """At most ``limit`` committed events from ``sequence >= cursor``, in order, stopping before their data
    would exceed ``max_bytes`` (None: no byte bound; the first event is always returned)."""
    rows = fetch_rows(
        conn,
        "SELECT sequence, event, data FROM events WHERE action_id = ? AND sequence >= ? ORDER BY sequence LIMIT ?",
        (action_id, cursor, limit),
    )
    if max_bytes is not None:
        total = 0
        for index, (_sequence, _event, data) in enumerate(rows):
            total += len(data)
            if total > max_bytes and index:  # the first event is always returned
                del rows[index:]
                break
    return [EventRow(*row) for row in rows]


def read_summary_and_events(
    conn: sqlite3.Connection, action_id: str, cursor: int, limit: int, max_bytes: int | None
) -> tuple[tuple[JobStatus, int, bool] | None, list[EventRow]]:
    """:func:`read_summary`, then :func:`read_events` of at most ``min(limit, event_count - cursor)`` events
    when ``0 <= cursor < event_count`` and the job is not archived; ``(summary, [])`` otherwise."""
    summary = read_summary(conn, action_id)
    if summary is None or summary[2] or not 0 <= cursor < summary[1] or limit <= 0:
        return summary, []
    return summary, read_events(conn, action_id, cursor, min(limit, summary[1] - cursor), max_bytes)


def task_run_hit(rows: Sequence[Sequence[Any]]) -> tuple[bytes, str, int | None] | None:
    """The hit of :meth:`~.store.Journal.find_task_run_hit` from its query's rows (output, result index,
    run state, job id): the run's output JSON bytes (a batch item's for a batch_run, its recorded
    :class:`RunState` keys added), the job id and the result index; None without a usable run."""
    if not rows or rows[0][0] is None:
        return None
    output, index, state, action_id = rows[0]
    if index is None and state is None:
        return bytes(output), action_id, index
    run: dict[str, Any]
    if index is None:
        run = msgspec.json.decode(output)
    else:
        results = msgspec.json.decode(output).get("results") or []
        if not 0 <= index < len(results):
            return None
        run = results[index]
    if state is not None:
        run = {**run, **msgspec.json.decode(state)}
    return msgspec.json.encode(run), action_id, index
