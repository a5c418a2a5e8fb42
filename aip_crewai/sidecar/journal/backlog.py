"""Terminal outcomes the journal failed to record, kept and retried.

When the terminal transaction of a job fails (a full disk, an I/O error),
the job has run but its journal row still says ``running``. The outcome is
kept here and retried with backoff; meanwhile the runtime refuses new jobs
(507) and ``/health`` reports ``degraded``, so no further work starts whose
result could not be recorded either. Once the journal takes the outcome the
job has its one true terminal event and admissions resume. If the process
stops first, the crash fence of the next start fails the job as uncertain,
which is still exactly one terminal event.

Source: ARCHITECTURE.md §4 ("journal write failure 507 (nothing half-admitted)"),
§5 (durability, crash fence).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from aip_crewai.sidecar.errors import JournalWriteFailed
from aip_crewai.sidecar.jobs.model import EventRow, JobStatus, RunState, TaskRunRef
from aip_crewai.sidecar.journal.store import Journal

log = structlog.get_logger(__name__)

#: First and longest pause between retries, seconds.
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0


@dataclass
class PendingTerminal:
    """The arguments of one failed terminal :meth:`Journal.transition`."""

    action_id: str
    operation: str
    status: JobStatus
    first_sequence: int
    events: list[EventRow]
    output: bytes | None = None
    error: bytes | None = None
    dropped_events: int = 0
    task_runs: list[TaskRunRef] = field(default_factory=list)
    run_states: list[RunState] = field(default_factory=list)


class TerminalBacklog:
    """Unrecorded terminal outcomes of one runtime.

    Args:
        journal: the open journal.
        on_recorded: called with each outcome once the journal took it.
    """

    def __init__(self, journal: Journal, on_recorded: Callable[[PendingTerminal], None]) -> None:
        self.journal = journal
        self._on_recorded = on_recorded
        self._pending: dict[str, PendingTerminal] = {}
        self._retry: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, action_id: object) -> bool:
        """Whether ``action_id``'s outcome waits here (its job ended, the journal has not taken it)."""
        return action_id in self._pending

    def add(self, item: PendingTerminal) -> None:
        """Keep ``item`` and make sure a retry loop runs."""
        self._pending[item.action_id] = item
        if self._retry is None or self._retry.done():
            self._retry = asyncio.create_task(self._retry_loop(), name="journal-backlog-retry")

    async def flush(self) -> bool:
        """Try to record every kept outcome, in admission order; True when none is left."""
        async with self._lock:
            for action_id, item in list(self._pending.items()):
                try:
                    applied = await self.journal.transition(
                        item.action_id,
                        item.status,
                        first_sequence=item.first_sequence,
                        events=item.events,
                        output=item.output,
                        error=item.error,
                        dropped_events=item.dropped_events,
                        task_runs=item.task_runs,
                        run_states=item.run_states,
                    )
                except JournalWriteFailed:
                    return False
                del self._pending[action_id]
                if applied:
                    log.warning("job_terminal_recorded_late", action_id=action_id, status=item.status.value)
                    self._on_recorded(item)
                else:  # the row moved on meanwhile (cannot happen with one writer): nothing to add
                    log.error("job_terminal_not_recorded", action_id=action_id, reason="stale")
            return True

    async def _retry_loop(self) -> None:
        delay = FIRST_RETRY_S
        while self._pending:
            await asyncio.sleep(delay)
            if await self.flush():
                log.info("journal_recovered")
                return
            delay = min(delay * 2, MAX_RETRY_S)

    async def close(self) -> None:
        """Stop retrying (kept outcomes stay ``running`` in the journal: the next start's crash fence ends them)."""
        if self._retry is not None and not self._retry.done():
            self._retry.cancel()
            await asyncio.gather(self._retry, return_exceptions=True)
        if self._pending:
            log.error("job_terminals_unrecorded_at_shutdown", jobs=len(self._pending))
