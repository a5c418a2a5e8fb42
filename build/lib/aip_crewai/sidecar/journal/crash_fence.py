"""The sidecar's crash fence: at start, before serving, every job a dead process left unfinished gets
a terminal ``failed`` event ``{status, error_type: "SidecarRestarted", message, uncertain_outcome}``:
uncertain for a job left ``running``, certain for one left ``queued`` (``started`` commits before
CrewAI runs, so a queued job never reached it). Nothing is re-run.

Source: ARCHITECTURE.md §5 (Crash fence).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

import msgspec

from aip_crewai.sidecar.jobs.model import JobStatus

__all__ = ["RESTARTED_RUNNING", "RESTARTED_QUEUED", "UNFINISHED_JOBS", "end_unfinished"]

#: Crash fence messages (ARCHITECTURE.md §5). A queued job never reached CrewAI
#: (``started`` commits before execution), so its outcome is certain.
RESTARTED_RUNNING = "sidecar restarted before CrewAI produced a terminal result"
RESTARTED_QUEUED = "sidecar restarted before the job started; CrewAI never ran it"
#: The jobs a previous process left unfinished.
UNFINISHED_JOBS = "SELECT action_id, status, event_count FROM jobs WHERE status IN ('queued', 'running')"


def end_unfinished(conn: sqlite3.Connection, found: Sequence[Sequence[Any]], now: int) -> list[tuple[str, JobStatus]]:
    """Give each job of ``found`` (rows of :data:`UNFINISHED_JOBS`) its terminal ``failed`` event, inside
    the caller's write transaction on ``conn``; a row changed meanwhile is skipped (the guarded update).
    ``now``: epoch ms. Returns ``[(action_id, previous status)]`` of the jobs ended."""
    recovered: list[tuple[str, JobStatus]] = []
    for action_id, status, count in found:
        running = status == JobStatus.RUNNING.value
        data = msgspec.json.encode(
            {
                "status": "failed",
                "error_type": "SidecarRestarted",
                "message": RESTARTED_RUNNING if running else RESTARTED_QUEUED,
                "uncertain_outcome": running,
            }
        )
        cur = conn.execute(
            "UPDATE jobs SET status = 'failed', error = ?, event_count = event_count + 1, updated_at = ? "
            "WHERE action_id = ? AND status = ? AND event_count = ?",
            (data, now, action_id, status, count),
        )
        if cur.rowcount == 1:
            conn.execute("INSERT INTO events VALUES (?, ?, 'failed', ?)", (action_id, count, data))
            recovered.append((action_id, JobStatus(status)))
    return recovered
