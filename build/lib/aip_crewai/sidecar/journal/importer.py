"""``aip-crewai journal import``: migrate a reference sidecar's JSON journal into a SQLite journal.

The reference sidecar keeps its runs in one JSON file (its
``AIP_CREWAI_STATE_FILE``, often ``runs.json``): a list of
``{action_id, crew_id, operation, input_hash, status, events, output}``,
``events`` being ``[{event, sequence, data}]`` with sequences from 0 (the
job view and events of ARCHITECTURE.md §4). Each run becomes one finished
job with its events:

- ``completed``, ``failed``, ``cancelled``: kept as they are (a missing
  terminal event is added, so every job ends with exactly one);
- ``running`` (the reference stopped before it ended): ``failed`` with a
  terminal event ``{error_type: "SidecarRestarted", uncertain_outcome: true}``,
  as our crash fence records it (ARCHITECTURE.md §5). Nothing is re-run.

Every run is held to the sidecar's own bounds (:class:`ImportLimits`: events
per run, bytes per event, the 4 MiB output, the input depth bound on event
data and output); the file is read in bounded pieces and decoded within the
decoder's nesting bound. A run that breaks one refuses the whole file with
one line naming the run and the bound (exit 2), before anything is written.

Imported jobs are marked ``imported`` (journal column, job view). An
admission naming an imported job's action id is 409, whatever its request
hash: its output was never produced here, so a governed action is never
answered from it (docs/operating.md "Migrating from the reference sidecar"). Importing
twice changes nothing (jobs already present are left alone). The JSON file
is only read: no lock file is created beside it, and a reference sidecar
still holding ``<file>.lock`` is refused.

Source: docs/operating.md "Migrating from the reference sidecar"; ARCHITECTURE.md §4, §5.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from aip_crewai.contracts.errors import AipError
from aip_crewai.contracts.inputs import MAX_INPUT_DEPTH, exceeds_depth
from aip_crewai.contracts.operations import STARTABLE_OPERATIONS
from aip_crewai.contracts.sidecar import MAX_OUTPUT_BYTES
from aip_crewai.plumbing.files import FileTooLarge, NotRegularFile, read_regular
from aip_crewai.sidecar.jobs.model import TERMINAL_EVENTS, EventRow, ImportedJob, JobStatus, task_refs
from aip_crewai.sidecar.journal.crash_fence import RESTARTED_RUNNING
from aip_crewai.sidecar.journal.store import Journal

#: Largest reference journal read, bytes (the reference's own ``AIP_CREWAI_MAX_STATE_BYTES`` bound).
MAX_REFERENCE_BYTES = 4_294_967_296
#: Event names of the sidecar contract (ARCHITECTURE.md §4).
EVENT_NAMES = frozenset({"started", "chunk"}) | TERMINAL_EVENTS
#: Bound of action and crew ids, characters (the reference's request bounds).
MAX_ID_CHARS = 256


@dataclass(frozen=True)
class ImportLimits:
    """The sidecar bounds every imported run is held to (the ``journal import`` flags; defaults: the
    sidecar's): events per run, terminal included (``--max-events-per-run``), and the encoded size of one
    event, bytes (``--max-event-bytes``). The 4 MiB output and the depth bound are fixed."""

    max_events_per_run: int = 1000
    max_event_bytes: int = 262_144


class ReferenceJournalError(ValueError):
    """The reference journal cannot be imported; the message names the file and, when one is at fault, the run."""


class _Event(msgspec.Struct):
    event: str
    sequence: int
    data: dict[str, Any]


class _Run(msgspec.Struct, kw_only=True):
    action_id: str
    crew_id: str
    operation: str = "run"
    input_hash: str
    status: str
    events: list[_Event] = []
    output: dict[str, Any] | None = None


def _json(value: Any) -> bytes:
    return msgspec.json.encode(value)


def read_reference(path: Path) -> list[_Run]:
    """Read and decode a reference JSON journal (a regular file, not a symlink, at most 4 GiB).

    Raises:
        ReferenceJournalError: unreadable, not JSON, not the reference's shape (the JSON path is named),
            or a reference sidecar still holds its lock.
    """
    _check_not_in_use(path)
    try:
        data = read_regular(path, MAX_REFERENCE_BYTES, follow_symlinks=False)
        runs = msgspec.json.decode(data, type=list[_Run])
    except (OSError, NotRegularFile, FileTooLarge) as exc:
        raise ReferenceJournalError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except RecursionError:  # nested deeper than the decoder allows (about 1000 levels)
        raise ReferenceJournalError(f"{path} nests JSON deeper than the decoder allows") from None
    except MemoryError:
        raise ReferenceJournalError(f"{path} does not fit in this process's memory") from None
    except msgspec.ValidationError as exc:
        raise ReferenceJournalError(f"{path} is not a reference sidecar journal: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ReferenceJournalError(f"{path} is not JSON: {exc}") from None
    return runs


def _check_not_in_use(path: Path) -> None:
    """Refuse while a reference sidecar holds ``<path>.lock``; never create that file."""
    lock_path = Path(f"{path}.lock")
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ReferenceJournalError(f"cannot check {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ReferenceJournalError(f"{path} is in use: a reference sidecar holds {lock_path}; stop it first") from None
    finally:
        os.close(fd)  # closing drops the shared lock taken for the check


def convert(run: _Run, *, created_at: int, limits: ImportLimits = ImportLimits()) -> ImportedJob:
    """One reference run as a finished job (rules in the module docstring).

    Raises:
        ReferenceJournalError: an unknown status, operation or event name, sequences not 0..n-1, a terminal
            event before the end or disagreeing with the status, ids out of bounds, or a bound of ``limits``,
            the output's or the depth's broken (the message names the run and the bound).
    """

    def bad(problem: str) -> ReferenceJournalError:
        return ReferenceJournalError(f"run {run.action_id[:MAX_ID_CHARS]!r}: {problem}")

    if not 1 <= len(run.action_id) <= MAX_ID_CHARS or not 1 <= len(run.crew_id) <= MAX_ID_CHARS:
        raise bad(f"action_id and crew_id must hold 1..{MAX_ID_CHARS} characters")
    if run.operation not in STARTABLE_OPERATIONS:
        raise bad(f"unknown operation {run.operation[:64]!r}")
    if run.status not in ("running", *TERMINAL_EVENTS):
        raise bad(f"unknown status {run.status[:64]!r}")
    rows: list[EventRow] = []
    for index, event in enumerate(run.events):
        if event.sequence != index:
            raise bad(f"event {index} has sequence {event.sequence}; sequences must be 0..{len(run.events) - 1}")
        if event.event not in EVENT_NAMES:
            raise bad(f"event {index} has the unknown name {event.event[:64]!r}")
        if event.event in TERMINAL_EVENTS and index != len(run.events) - 1:
            raise bad(f"event {index} ({event.event}) is terminal but not the last")
        if exceeds_depth(event.data):
            raise bad(f"event {index} nests deeper than {MAX_INPUT_DEPTH} levels of objects and arrays")
        rows.append(EventRow(index, event.event, _json(event.data)))
        if len(rows) > limits.max_events_per_run:
            raise bad(f"more than {limits.max_events_per_run} events (--max-events-per-run)")
    if run.output is not None and exceeds_depth(run.output):
        raise bad(f"its output nests deeper than {MAX_INPUT_DEPTH} levels of objects and arrays")
    last = rows[-1].event if rows else None
    status = run.status
    if status == "running":
        if last in TERMINAL_EVENTS:
            raise bad(f"status running, yet its last event is {last}")
        status = "failed"
        rows.append(
            EventRow(
                len(rows),
                "failed",
                _json(
                    {
                        "status": "failed",
                        "error_type": "SidecarRestarted",
                        "message": RESTARTED_RUNNING,
                        "uncertain_outcome": True,
                    }
                ),
            )
        )
    elif last is None or last not in TERMINAL_EVENTS:
        rows.append(EventRow(len(rows), status, _json(_missing_terminal(status, run.output))))
    elif last != status:
        raise bad(f"status {status}, yet its last event is {last}")
    output = None
    if status == "completed":
        output = _json(run.output) if run.output is not None else rows[-1].data
    _check_bounds(bad, rows, output, limits)
    return ImportedJob(
        action_id=run.action_id,
        crew_id=run.crew_id,
        operation=run.operation,
        request_hash=run.input_hash,
        status=JobStatus(status),
        events=tuple(rows),
        output=output,
        error=rows[-1].data if status == "failed" else None,
        task_runs=tuple(task_refs(run.operation, msgspec.json.decode(output) if output else None)),
        created_at=created_at,
    )


def _check_bounds(
    bad: Callable[[str], ReferenceJournalError], rows: list[EventRow], output: bytes | None, limits: ImportLimits
) -> None:
    """The sidecar's own bounds on a converted run (its terminal event included). Raises ``bad(problem)``."""
    if len(rows) > limits.max_events_per_run:
        raise bad(
            f"{len(rows)} events with its terminal one; at most {limits.max_events_per_run} (--max-events-per-run)"
        )
    for row in rows:
        size = len(row.to_json())
        if size > limits.max_event_bytes:
            raise bad(f"event {row.sequence} is {size} bytes; at most {limits.max_event_bytes} (--max-event-bytes)")
    if output is not None and len(output) > MAX_OUTPUT_BYTES:
        raise bad(f"its output is {len(output)} bytes; at most {MAX_OUTPUT_BYTES} (the sidecar's output bound)")


def _missing_terminal(status: str, output: dict[str, Any] | None) -> dict[str, Any]:
    if status == "completed":
        return output if output is not None else {"status": "completed"}
    if status == "failed":
        return {
            "status": "failed",
            "error_type": "ImportedWithoutTerminalEvent",
            "message": "the reference journal recorded the failure without its event",
            "uncertain_outcome": True,
        }
    return {"status": "cancelled"}


def default_target(source: Path) -> Path:
    """Where the SQLite journal goes when ``--journal`` is not given: beside the source, suffix ``.db``."""
    return source.with_suffix(".db") if source.suffix != ".db" else source.with_name(source.name + ".sqlite")


async def import_file(source: Path, target: Path, limits: ImportLimits = ImportLimits()) -> dict[str, Any]:
    """Import ``source`` (a reference JSON journal) into the SQLite journal ``target`` (created when absent).

    Returns:
        ``{"journal", "imported", "already_present", "conflicts"}``: counts, and the conflicting action ids
        (present in ``target`` with another request hash; left as they are).

    Raises:
        ReferenceJournalError: the source cannot be imported (nothing is written).
        AipError (JournalError): the target cannot be opened (locked by a running sidecar, insecure, foreign).
    """
    runs = read_reference(source)
    if len({run.action_id for run in runs}) != len(runs):
        raise ReferenceJournalError(f"{source} holds an action id twice")
    created_at = int(os.stat(source).st_mtime * 1000)
    jobs = [convert(run, created_at=created_at, limits=limits) for run in runs]
    journal = await Journal.open(target)
    try:
        imported, present, conflicts = await journal.import_jobs(jobs)
    finally:
        await journal.close()
    return {"journal": str(target), "imported": len(imported), "already_present": len(present), "conflicts": conflicts}


def main(args: argparse.Namespace) -> int:
    """``aip-crewai journal import PATH [--journal NEW]``: exit 0 when everything is in the journal,
    1 when some action ids conflict or the journal cannot be written, 2 when the source cannot be imported."""
    source = Path(args.source)
    target = Path(args.target) if args.target else default_target(source)
    limits = ImportLimits(args.max_events_per_run, args.max_event_bytes)
    try:
        # stdout carries the report only: the journal's log lines (structlog's default prints to the
        # current sys.stdout) go to stderr; the process-wide logging configuration is left alone.
        with contextlib.redirect_stdout(sys.stderr):
            report = asyncio.run(import_file(source, target, limits))
    except ReferenceJournalError as exc:
        print(f"aip-crewai: {exc}", file=sys.stderr)
        return 2
    except AipError as exc:
        print(f"aip-crewai: {target}: {exc.message}", file=sys.stderr)
        return 1
    print(
        json.dumps(report, separators=(",", ":"))
        if args.json
        else f"{report['imported']} imported, {report['already_present']} already present, "
        f"{len(report['conflicts'])} conflicting into {report['journal']}; start the sidecar with "
        f"--journal {report['journal']}"
    )
    for action_id in report["conflicts"]:  # escaped: an id is the file's text, never terminal control
        print(
            f"aip-crewai: conflict: {action_id!r} is in {target} with another request; left as it is", file=sys.stderr
        )
    return 1 if report["conflicts"] else 0
