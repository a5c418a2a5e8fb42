"""The job model shared by the journal and the runtime (pure data, no I/O).

Job states and their allowed transitions, the persisted job record, and the
event row with its wire encoding ``{"event","sequence","data"}``.

Source: ARCHITECTURE.md §4 (events), §5 (journal), ARCHITECTURE.md §2.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec


class JobStatus(str, enum.Enum):
    """Job states. ``queued``: admitted and committed, waiting for a concurrency
    slot (CrewAI has not started); ``running``: the ``started`` event is committed."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})
TERMINAL_EVENTS = frozenset(s.value for s in _TERMINAL)

#: Allowed transitions; the journal's SQL ``WHERE`` clause refuses every other one.
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.COMPLETED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


def sources_of(target: JobStatus) -> tuple[str, ...]:
    """States from which ``target`` may be entered (sorted values)."""
    return tuple(sorted(s.value for s, targets in TRANSITIONS.items() if target in targets))


@dataclass(frozen=True)
class NewJob:
    """An admission: the row committed before CrewAI starts."""

    action_id: str
    crew_id: str
    operation: str
    request_hash: str
    idempotency_key: str
    timeout_ms: int | None


@dataclass(frozen=True)
class JobRecord:
    """One persisted job.

    ``output`` (completed output) and ``error`` (failed event data) are
    compact JSON bytes or None; ``provider_stop_observed`` is None until a
    stopped job's worker returned; times are Unix milliseconds.
    """

    action_id: str
    crew_id: str
    operation: str
    request_hash: str
    idempotency_key: str
    timeout_ms: int | None
    status: JobStatus
    event_count: int
    output: bytes | None
    error: bytes | None
    dropped_events: int
    provider_stop_observed: bool | None
    archived: bool
    created_at: int
    updated_at: int
    #: Imported from a reference journal (``aip-crewai journal import``): never answered to an admission.
    imported: bool = False


class EventRow(msgspec.Struct, frozen=True):
    """One event; ``data`` is the compact JSON bytes of the event's data object.

    A msgspec Struct, not a dataclass: a replay page builds one per event, and a Struct is
    built in C (a frozen dataclass sets each field through ``object.__setattr__``).
    """

    sequence: int
    event: str
    data: bytes

    def to_json(self) -> bytes:
        """The whole event ``{"event","sequence","data"}`` as compact JSON bytes."""
        return b'{"event":%s,"sequence":%d,"data":%s}' % (msgspec.json.encode(self.event), self.sequence, self.data)

    @property
    def terminal(self) -> bool:
        return self.event in TERMINAL_EVENTS


class ArchiveOutcome(enum.Enum):
    ARCHIVED = "archived"
    ALREADY_ARCHIVED = "already_archived"
    NOT_FOUND = "not_found"
    NOT_TERMINAL = "not_terminal"


@dataclass(frozen=True)
class RunState:
    """What a replay of a completed run needs besides its output and inputs: ``state``
    is compact JSON ``{"fingerprint": [...]}`` (never crew inputs: those are kept
    in :mod:`replay_inputs` files); ``result_index``: batch item, else None."""

    result_index: int | None
    state: bytes


@dataclass(frozen=True)
class TaskRunRef:
    """A task id found in a completed output (``result_index``: batch item, else None)."""

    task_id: str
    result_index: int | None = None


@dataclass(frozen=True)
class ImportedJob:
    """A finished job migrated from a reference sidecar's JSON journal (``aip-crewai journal import``).

    ``status`` is terminal; ``events`` are its whole history, sequences from 0,
    the terminal event last; ``output`` (completed) and ``error`` (failed event
    data) are compact JSON bytes; ``task_runs`` index a completed run for replay.
    ``created_at`` in epoch milliseconds.

    Source: docs/operating.md "Migrating from the reference sidecar".
    """

    action_id: str
    crew_id: str
    operation: str
    request_hash: str
    status: JobStatus
    events: tuple[EventRow, ...]
    output: bytes | None
    error: bytes | None
    task_runs: tuple[TaskRunRef, ...]
    created_at: int


def task_refs(operation: str, output: Any) -> list[TaskRunRef]:
    """Task ids in a completed run/replay/batch_run output (ARCHITECTURE.md §4 Outputs)."""
    if not isinstance(output, dict):
        return []
    if operation in ("run", "replay"):
        items: list[tuple[int | None, Any]] = [(None, output)]
    elif operation == "batch_run":
        items = list(enumerate(output.get("results") or []))
    else:
        return []
    refs: list[TaskRunRef] = []
    for index, item in items:
        for task in (item.get("tasks_output") or []) if isinstance(item, dict) else []:
            task_id = task.get("task_id") if isinstance(task, dict) else None
            if isinstance(task_id, str) and 0 < len(task_id.encode()) <= 256:
                refs.append(TaskRunRef(task_id, index))
    return refs
