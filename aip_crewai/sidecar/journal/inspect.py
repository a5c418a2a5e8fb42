"""``aip-crewai journal list|inspect``: read-only views of a journal file.

Opens the journal read-only (no lock, no migration), so it is safe beside a
running sidecar, and refuses a damaged file whole (SQLite's integrity check, as
the sidecar's start-up runs it). Outputs and event data are shown as stored (as
JSON: control characters escaped); crew inputs are never stored in the journal.
An id is the file's text, never terminal control: the table and every message
print it escaped (:func:`shown`), as ``journal import`` does.

Source: issue "The main job end to end" item 3 (the CLI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...contracts import display
from ...contracts.errors import AipError
from ..jobs.model import JobRecord
from .store import Journal


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def shown(text: str) -> str:
    """``text`` as it is when every character is printable, else as Python writes it escaped
    (``'acme:\\x1b[31mred'``): a crafted id never sets the terminal's title or colours. Pure."""
    return text if text.isprintable() else repr(text)


def _job(record: JobRecord) -> dict[str, Any]:
    return {
        "action_id": record.action_id,
        "crew_id": record.crew_id,
        "operation": record.operation,
        "status": record.status.value,
        "event_count": record.event_count,
        "archived": record.archived,
        "provider_stop_observed": record.provider_stop_observed,
        "dropped_events": record.dropped_events,
        "created_at": _when(record.created_at),
        "updated_at": _when(record.updated_at),
        "error": json.loads(record.error) if record.error else None,
    }


async def _run(args: argparse.Namespace) -> int:
    journal = await Journal.open_readonly(Path(args.journal))
    try:
        if args.journal_command == "list":
            jobs = [_job(r) for r in await journal.list_jobs(max(1, min(args.limit, 10_000)))]
            if args.json:
                print(json.dumps(jobs, separators=(",", ":")))
            else:
                print(f"{'created':<21}{'status':<11}{'operation':<17}{'events':>7}  {'crew':<20} action")
                for job in jobs:
                    print(
                        f"{job['created_at']:<21}{job['status']:<11}{job['operation']:<17}{job['event_count']:>7}  "
                        f"{shown(job['crew_id']):<20} {shown(job['action_id'])}"
                    )
            return 0
        record = await journal.get(args.action_id)
        if record is None:  # an action id without its tenant prefix: the job of the one tenant that has it
            matches = await journal.job_ids_ending(args.action_id)
            if len(matches) > 1:
                print(
                    f"aip-crewai: {args.action_id!r} is an action of several tenants; give one of: "
                    f"{', '.join(map(shown, matches))}",
                    file=sys.stderr,
                )
                return 1
            record = await journal.get(matches[0]) if matches else None
        if record is None:
            print(f"aip-crewai: no job {args.action_id!r} in {args.journal}", file=sys.stderr)
            return 1
        events = [
            {"sequence": e.sequence, "event": e.event, "data": json.loads(e.data)}
            for e in await journal.read_events(record.action_id, 0, limit=100_000)
        ]
        view = {**_job(record), "output": json.loads(record.output) if record.output else None, "events": events}
        print(json.dumps(view, separators=(",", ":")) if args.json else display.dumps(view, indent=2))
        return 0
    finally:
        await journal.close()


def main(args: argparse.Namespace) -> int:
    """Entry of ``aip-crewai journal list|inspect``: 0, or 1 with one line on stderr when the file is not
    a readable journal (missing, not SQLite, another application's, a newer schema, damaged) or a read
    fails (a page damaged after the open's check). Source: docs/reference/cli.md (``journal``)."""
    try:
        return asyncio.run(_run(args))
    except AipError as exc:
        print(f"aip-crewai: {exc.message}", file=sys.stderr)
        return 1
    except sqlite3.DatabaseError as exc:
        print(f"aip-crewai: cannot read the journal {args.journal}: {exc}", file=sys.stderr)
        return 1
