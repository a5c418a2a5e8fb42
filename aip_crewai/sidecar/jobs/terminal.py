"""The one terminal event of a job: the executor's result turned into it, and its commit.

:class:`TerminalRecorder` is step 3 of a job's lifecycle (:mod:`runtime`): exactly one terminal event,
``completed`` (the output; over ``max_event_bytes`` the event carries
``{"status":"completed","output_omitted":true,"output_bytes":N}`` and the output stays on
``GET /jobs/{id}``), ``failed`` (class name, a fixed message unless :class:`SafeJobError`,
``uncertain_outcome`` = the catalogue's ``mutation``) or ``cancelled``, committed in one transaction
with the job's pending chunks. If the journal cannot take it (a full disk) the outcome is kept and
retried (:attr:`TerminalRecorder.backlog`, :mod:`backlog`).

Source: ARCHITECTURE.md §4 (events, outputs), §5 (durability).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import structlog

from aip_crewai.contracts.sidecar import MAX_OUTPUT_BYTES
from aip_crewai.sidecar.config import Settings
from aip_crewai.sidecar.errors import JournalWriteFailed
from aip_crewai.sidecar.http.metrics import Metrics
from aip_crewai.sidecar.jobs.context import GENERIC_FAILURE, JobContext, SafeJobError
from aip_crewai.sidecar.jobs.live import LiveJob
from aip_crewai.sidecar.jobs.model import EventRow, JobStatus, RunState, TaskRunRef, task_refs
from aip_crewai.sidecar.jobs.replay_inputs import ReplayInputs
from aip_crewai.sidecar.journal.backlog import PendingTerminal, TerminalBacklog
from aip_crewai.sidecar.journal.store import Journal
from aip_crewai.sidecar.tracing import job_failed

log = structlog.get_logger(__name__)

#: Bound on a SafeJobError message, characters.
MAX_SAFE_MESSAGE_CHARS = 2048


class TerminalRecorder:
    """Records each job's terminal event in the journal (see the module docstring).

    Args:
        settings: ``max_event_bytes``.
        journal: the runtime's journal.
        metrics: the runtime's counters (``jobs_finished_total``, ``chunks_dropped_total``,
            ``journal_write_failures_total``).
        live: the runtime's live jobs by action id; a job leaves it once its terminal event is committed
            (or could not be).
        replay_inputs: where a completed run's inputs are kept for ``replay``.
    """

    def __init__(
        self,
        settings: Settings,
        journal: Journal,
        metrics: Metrics,
        live: dict[str, LiveJob],
        replay_inputs: ReplayInputs,
    ) -> None:
        self.settings = settings
        self.journal = journal
        self.metrics = metrics
        self._live = live
        self.replay_inputs = replay_inputs
        #: Terminal outcomes the journal could not take yet, retried.
        self.backlog = TerminalBacklog(journal, self._recorded_late)

    async def record_outcome(self, live: LiveJob, task: asyncio.Task[Any], duration_ms: int) -> None:
        """Turn the executor's finished ``task`` into the terminal event (the caller has claimed ``live.close()``).

        Cancelled: ``cancelled``. Raised: ``failed`` (a :class:`SafeJobError`'s type and message, at most
        :data:`MAX_SAFE_MESSAGE_CHARS`; any other exception's class name and :data:`GENERIC_FAILURE`;
        ``uncertain_outcome`` = the catalogue's ``mutation`` unless the error says otherwise). Returned:
        ``completed`` with the output (``InvalidOutput`` / ``OutputTooLarge`` failures when it is not JSON
        or over ``MAX_OUTPUT_BYTES``), its task refs, crew fingerprints and replay inputs. A terminal
        event the journal cannot take goes to :attr:`backlog` (:meth:`finish`).
        """
        spec = live.spec
        exc = None if task.cancelled() else task.exception()
        if task.cancelled():
            await self.finish(live, JobStatus.CANCELLED, {"status": "cancelled"})
            return
        if exc is not None:
            if isinstance(exc, SafeJobError):
                error_type, message = exc.error_type, str(exc.message)[:MAX_SAFE_MESSAGE_CHARS]
            else:
                error_type, message = type(exc).__name__, GENERIC_FAILURE
            log.warning("job_failed", action_id=live.action_id, error_type=error_type, duration_ms=duration_ms)
            effect_free = isinstance(exc, SafeJobError) and exc.before_any_effect
            uncertain = spec.mutation and not effect_free
            if isinstance(exc, SafeJobError) and exc.uncertain is not None:
                uncertain = exc.uncertain
            await self.fail(live, error_type, message, uncertain)
            return
        try:
            output = msgspec.json.encode(task.result())
        except (TypeError, ValueError) as err:
            log.error("job_output_not_json", action_id=live.action_id, error_type=type(err).__name__)
            await self.fail(live, "InvalidOutput", "the operation output is not JSON", spec.mutation)
            return
        if len(output) > MAX_OUTPUT_BYTES:
            await self.fail(
                live,
                "OutputTooLarge",
                f"the operation output is {len(output)} bytes; at most {MAX_OUTPUT_BYTES} bytes",
                spec.mutation,
            )
            return
        data = output
        if len(EventRow(live.next_sequence, "completed", output).to_json()) > self.settings.max_event_bytes:
            data = msgspec.json.encode({"status": "completed", "output_omitted": True, "output_bytes": len(output)})
        refs = task_refs(live.operation, task.result())
        states = _run_states(live.ctx, refs)
        inputs = _run_inputs(live.ctx, refs)
        # In place before the terminal commit (once the run can be replayed, its inputs are there), fsynced
        # beside it: one disk flush's wait instead of two (replay_inputs.py).
        placed = bool(inputs) and await asyncio.to_thread(self.replay_inputs.place, live.action_id, inputs)
        log.info(
            "job_completed",
            action_id=live.action_id,
            output_bytes=len(output),
            duration_ms=duration_ms,
            events=live.next_sequence + 1,
            dropped_events=live.dropped,
        )
        await self.finish(
            live,
            JobStatus.COMPLETED,
            None,
            raw=data,
            output=output,
            task_runs=refs,
            run_states=states,
            beside=partial(self.replay_inputs.sync, live.action_id) if placed else None,
        )

    async def fail(self, live: LiveJob, error_type: str, message: str, uncertain: bool) -> None:
        """Commit a ``failed`` terminal event ``{"status", "error_type", "message", "uncertain_outcome"}``."""
        data = {"status": "failed", "error_type": error_type, "message": message, "uncertain_outcome": uncertain}
        job_failed(error_type)  # on the job's span, when this runs under it
        await self.finish(live, JobStatus.FAILED, data, error=msgspec.json.encode(data))

    async def finish(
        self,
        live: LiveJob,
        status: JobStatus,
        data: dict[str, Any] | None,
        *,
        raw: bytes | None = None,
        output: bytes | None = None,
        error: bytes | None = None,
        task_runs: list[TaskRunRef] | None = None,
        run_states: list[RunState] | None = None,
        beside: Callable[[], object] | None = None,
    ) -> None:
        """Commit pending chunks and the terminal event in one transaction.

        ``beside``: blocking work run in a thread while the transaction commits (the replay inputs'
        fsync); both are finished before the job's followers are told it ended.

        The caller has claimed ``live.close()``. On a journal failure the job
        is marked lost (followers stop without a terminal event) and the
        outcome goes to :attr:`backlog`, which retries it while new
        admissions get 507; if the process stops first, the next start fails
        the job as uncertain.
        """
        async with live.flush_lock:
            sequence = live.next_sequence
            terminal = EventRow(sequence, status.value, raw if raw is not None else msgspec.json.encode(data))
            events = [*live.pending, terminal]
            alongside = asyncio.ensure_future(asyncio.to_thread(beside)) if beside is not None else None
            try:
                ok: bool | None = await self.journal.transition(
                    live.action_id,
                    status,
                    first_sequence=live.committed,
                    events=events,
                    output=output,
                    error=error,
                    dropped_events=live.dropped,
                    task_runs=task_runs or (),
                    run_states=run_states or (),
                )
            except JournalWriteFailed:
                ok = None
                self.metrics.inc("journal_write_failures_total")
            finally:
                if alongside is not None:
                    await asyncio.shield(alongside)  # never raises: ReplayInputs.sync logs its own failure
            if ok:
                live.pending.clear()
                live.status, live.committed, live.next_sequence = status, sequence + 1, sequence + 1
                self.metrics.inc("jobs_finished_total", operation=live.operation, status=status.value)
                if live.dropped:
                    self.metrics.inc("chunks_dropped_total", live.dropped)
            else:
                live.lost = True
                log.error(
                    "job_terminal_not_recorded", action_id=live.action_id, status=status.value, retrying=ok is None
                )
                if ok is None:
                    self.backlog.add(
                        PendingTerminal(
                            live.action_id,
                            live.operation,
                            status,
                            live.committed,
                            events,
                            output,
                            error,
                            live.dropped,
                            list(task_runs or ()),
                            list(run_states or ()),
                        )
                    )
        live.finished.set()
        live.notify()
        self._live.pop(live.action_id, None)

    def _recorded_late(self, item: PendingTerminal) -> None:
        self.metrics.inc("jobs_finished_total", operation=item.operation, status=item.status.value)


def _run_states(ctx: JobContext | None, refs: list[TaskRunRef]) -> list[RunState]:
    """The crew fingerprints the operation left in ``ctx.run_state``, for the results that have task refs."""
    if ctx is None or not refs:
        return []
    indexes = {ref.result_index for ref in refs}
    return [
        RunState(index, msgspec.json.encode({"fingerprint": state["fingerprint"]}))
        for index, state in ctx.run_state.items()
        if index in indexes and isinstance(state, dict) and "fingerprint" in state
    ]


def _run_inputs(ctx: JobContext | None, refs: list[TaskRunRef]) -> dict[int | None, dict[str, Any]]:
    """The inputs the operation left in ``ctx.run_state``, for the results that have task refs."""
    if ctx is None or not refs:
        return {}
    indexes = {ref.result_index for ref in refs}
    return {
        index: state["inputs"]
        for index, state in ctx.run_state.items()
        if index in indexes and isinstance(state, dict) and isinstance(state.get("inputs"), dict)
    }
