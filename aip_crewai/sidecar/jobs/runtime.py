"""The job runtime: admission, execution under bounds, cancellation, reads.

Lifecycle of one job (ARCHITECTURE.md §4, §5):

1. :meth:`Runtime.admit`: journal-free checks (:mod:`admission`), then the
   journal: an existing action id returns its record (409 on another hash);
   replay needs a retained run holding its task id (422); memory_reset beside
   another job of its tenant and crew, or any job beside a running
   memory_reset of it, is 409 ``crew_busy``; the ``queued`` row
   is committed before anything runs (507 when full or on a write failure).
2. The job waits for a slot of the concurrency semaphore, commits
   ``started`` (queued → running), then calls the executor with a
   :class:`JobContext`. Chunks arrive through ``ctx.emit_chunk`` from any
   thread; they are bounded, shaped, visible to followers at once and
   committed every ``stream_checkpoint_events``.
3. Exactly one terminal event, committed at once with any pending chunks:
   ``completed`` (the output; over ``max_event_bytes`` the event carries
   ``{"status":"completed","output_omitted":true,"output_bytes":N}`` and the
   output stays on ``GET /jobs/{id}``), ``failed`` (class name, a fixed
   message unless :class:`SafeJobError`, ``uncertain_outcome`` = the
   catalogue's ``mutation``) or ``cancelled`` (:mod:`terminal`). If the journal
   cannot take it (a full disk), the outcome is kept and retried (:mod:`backlog`);
   until it is recorded ``/health`` says ``degraded`` and new jobs get 507.

Execution bound: ``timeout_ms`` (default 600000, max 3600000) bounds the job's
execution, counted from ``started``; past it the job is stopped like a cancel
and fails with ``error_type: "ExecutionTimeout"``. A blocking ``POST /jobs``
waits at most ``timeout_ms`` from its own arrival and answers 504 while the
job keeps running (it was queued, or is being stopped).

Cancellation (operations whose catalogue ``cancel`` is true): the terminal
``cancelled`` event is committed at once and the cancel flag set; run and
batch_run also get their asyncio task cancelled (``akickoff`` stops at its
next await); replay, train and test stop at their next model call. The
concurrency slot is held until the worker really returns; then
``provider_stop_observed`` is recorded (True when the worker stopped on the
cancel: task cancelled, JobCancelled raised, or ``ctx.stop_observed``).
knowledge_query and memory_reset are not cancellable: 409 while running.
An executor with ``stops_by_task`` (the process-isolated ``workers.WorkerPool``)
has its task cancelled for every operation, and a timeout or shutdown stops it
the same way: it asks its worker to stop and kills it after the grace
(ARCHITECTURE.md §5 "Isolation").

The read side (views, event pages, live followers) is :mod:`reader`.

Source: ARCHITECTURE.md §4, §5 (limits).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Collection, Coroutine, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import structlog

from aip_crewai.contracts.operations import get as operation_spec
from aip_crewai.sidecar.config import Settings
from aip_crewai.sidecar.errors import (
    CrewBusy,
    CursorOutOfRange,
    Draining,
    JobNotCancellable,
    JobNotFound,
    JobStillRunning,
    JournalReplaced,
    JournalWriteFailed,
    RequestConflict,
    ShuttingDown,
    TaskRunNotFound,
)
from aip_crewai.sidecar.http.metrics import Metrics
from aip_crewai.sidecar.isolation.sandbox import report as sandbox_report
from aip_crewai.sidecar.jobs.admission import Admission, check_request
from aip_crewai.sidecar.jobs.context import TASK_CANCELLED_OPERATIONS, JobCancelled, JobContext
from aip_crewai.sidecar.jobs.live import LiveJob, chunk_row, event_row
from aip_crewai.sidecar.jobs.model import ArchiveOutcome, EventRow, JobRecord, JobStatus, NewJob
from aip_crewai.sidecar.jobs.reader import JobReader
from aip_crewai.sidecar.jobs.replay_inputs import ReplayInputs
from aip_crewai.sidecar.jobs.terminal import TerminalRecorder
from aip_crewai.sidecar.journal.store import Journal
from aip_crewai.sidecar.tenancy import tenant_of
from aip_crewai.sidecar.tracing import crew_spans, end_job, job_attributes, job_span
from aip_crewai.tracing import current_traceparent

log = structlog.get_logger(__name__)

#: ``async executor(crew_id, operation, input, ctx) -> output``.
Executor = Callable[[str, str, dict[str, Any], JobContext], Coroutine[Any, Any, dict[str, Any]]]

#: How long a failed admission write keeps ``/health`` ``degraded`` (s), unless an admission succeeds first.
RECENT_WRITE_FAILURE_SECONDS = 30.0


class Runtime:
    """Owns live jobs, the semaphore and the executor; the journal is shared.

    Args:
        settings: limits and directories.
        journal: an open journal (recovered).
        crews: registered crew ids.
        executor: runs one operation (injectable for tests).
    """

    def __init__(
        self,
        settings: Settings,
        journal: Journal,
        crews: Collection[str],
        executor: Executor,
        *,
        crew_problems: Mapping[str, list[str]] | None = None,
        crew_inputs: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.crew_problems = {crew: list(codes) for crew, codes in (crew_problems or {}).items()}
        self.crew_inputs = {crew: dict(facts) for crew, facts in (crew_inputs or {}).items()}
        self.journal = journal
        self.crews = frozenset(crews)
        self._executor = executor
        #: A process-isolated executor stops every operation through its task (hard cancel, ``workers``).
        self._stops_by_task = bool(getattr(executor, "stops_by_task", False))
        self._semaphore = asyncio.Semaphore(settings.max_concurrency)
        self._live: dict[str, LiveJob] = {}
        self._admitting: dict[str, Admission] = {}  # passed every check, row not yet registered in _live
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._draining = False
        self._admission_write_failed_at: float | None = None  # monotonic s of the last failed admission write
        self.metrics = Metrics()
        self._state_dir = settings.state_dir or (settings.journal.parent if settings.journal else Path.cwd())
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.replay_inputs = ReplayInputs(self._state_dir)
        self.terminals = TerminalRecorder(settings, journal, self.metrics, self._live, self.replay_inputs)
        self.backlog = self.terminals.backlog
        self.reads = JobReader(journal, self._live, settings.sse_keepalive_seconds, unrecorded=self.backlog)

    # ------------------------------------------------------------ admission

    async def admit(
        self, body: bytes, *, idempotency_key: str | None, header_action_id: str | None, resume_cursor: int = 0
    ) -> Admission:
        """Admit a job (or find its existing record); return the checked request. ``resume_cursor`` > 0: a
        stream resumed past event 0 (``Last-Event-ID``), refused (416) with nothing admitted for a new job.

        Raises every admission error of ARCHITECTURE.md §4 (see :mod:`admission`),
        JournalReplaced (503: the journal's path names another file now),
        CrewBusy (409: memory_reset beside another job of its tenant and crew, see
        :meth:`_check_crew_free`),
        RequestConflict (409), TaskRunNotFound (422), CursorOutOfRange (416), JournalFull /
        JournalWriteFailed (507), ShuttingDown (503), Draining (503, a new job while
        :meth:`drain` runs).
        """
        if self._closing:
            raise ShuttingDown()
        if not self.journal.still_at_path():
            log.error("journal_replaced", journal=str(self.journal.path))
            raise JournalReplaced()
        adm = check_request(
            body,
            idempotency_key=idempotency_key,
            header_action_id=header_action_id,
            allowed_operations=self.settings.allowed_operations,
            crews=self.crews,
        )
        existing = await self.journal.get(adm.action_id)
        if existing is not None:
            self._repeat(existing, adm)
            return adm
        if resume_cursor > 0:
            raise CursorOutOfRange(f"cursor {resume_cursor} is outside the journal: job {adm.action_id!r} is new")
        if self._draining:
            raise Draining()
        if adm.operation == "replay":
            task_id = adm.input["task_id"]
            if await self.journal.find_task_run(adm.crew_id, task_id, tenant_of(adm.action_id)) is None:
                raise TaskRunNotFound(
                    f"task_id {task_id!r} belongs to no retained completed run of crew {adm.crew_id!r} for this tenant"
                )
        self._check_crew_free(adm)
        self._admitting[adm.action_id] = adm  # seen by concurrent admissions from here on (no await before)
        try:
            # Shielded: once the row may be committed, registration must not be cut off.
            await asyncio.shield(self._admit_new(adm))
        finally:
            self._admitting.pop(adm.action_id, None)
        return adm

    def _forget_task(self, action_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(action_id, None)

    def _check_crew_free(self, adm: Admission) -> None:
        """Refuse ``memory_reset`` beside another unfinished job of its (tenant, crew), and any job beside
        a running ``memory_reset`` of it (a run ending after the reset would write its memories back).

        Synchronous, so the check and the caller's registration in ``_admitting`` are one step.

        Raises:
            CrewBusy: 409 ``sidecar.crew_busy``.
        """
        tenant = tenant_of(adm.action_id)
        others = [
            (live.operation, live.action_id)
            for live in self._live.values()
            if not live.closed and live.crew_id == adm.crew_id and live.tenant == tenant
        ]
        others += [
            (other.operation, other.action_id)
            for other in self._admitting.values()
            if other.crew_id == adm.crew_id and tenant_of(other.action_id) == tenant
        ]
        others = [(op, aid) for op, aid in others if aid != adm.action_id]
        if adm.operation == "memory_reset" and others:
            raise CrewBusy(
                f"crew {adm.crew_id!r} has {len(others)} job(s) queued or running for this tenant; "
                "memory_reset is refused until they are finished"
            )
        if any(op == "memory_reset" for op, _aid in others):
            raise CrewBusy(
                f"a memory_reset of crew {adm.crew_id!r} is running for this tenant; retry when it is finished"
            )

    def _repeat(self, record: JobRecord, adm: Admission) -> None:
        if record.imported:  # its output was never produced here: never answered to a governed action
            raise RequestConflict(
                f"action id {adm.action_id!r} names a job imported from a reference journal; "
                "it is never admitted or answered again (use a new action id)"
            )
        if record.request_hash != adm.request_hash:
            raise RequestConflict(f"action id {adm.action_id!r} was already admitted with a different request")
        if record.archived:
            raise RequestConflict(f"action id {adm.action_id!r} belongs to an archived job")

    async def _admit_new(self, adm: Admission) -> None:
        job = NewJob(
            adm.action_id, adm.crew_id, adm.operation, adm.request_hash, adm.idempotency_key, adm.requested_timeout_ms
        )
        if len(self.backlog) and not await self.backlog.flush():
            # Earlier outcomes could not be recorded: start nothing whose outcome could not be either.
            self.metrics.inc("journal_write_failures_total")
            raise JournalWriteFailed(
                "the job journal cannot record results right now; no new job is admitted "
                "until it records the pending ones"
            )
        # A free concurrency slot: the job is taken into it now and admitted `running` with its `started`
        # event, one commit instead of two (ARCHITECTURE.md §5); else it is admitted `queued` and waits.
        slot, created = not self._semaphore.locked(), False
        if slot:
            await self._semaphore.acquire()  # free: returns without waiting
        try:
            record, created = await self.journal.admit(
                job,
                max_retained_runs=self.settings.max_retained_runs,
                max_bytes=self.settings.max_journal_bytes,
                started=_started(adm.operation) if slot else None,
            )
        except JournalWriteFailed:
            self.metrics.inc("journal_write_failures_total")
            self._admission_write_failed_at = time.monotonic()
            raise
        finally:
            if slot and not created:
                self._semaphore.release()
        self._admission_write_failed_at = None
        if not created:
            self._repeat(record, adm)
            return
        live = LiveJob(adm.action_id, adm.crew_id, adm.spec, adm.timeout_ms)
        if slot:
            live.status, live.committed, live.next_sequence = JobStatus.RUNNING, 1, 1
        self._live[adm.action_id] = live
        task = asyncio.create_task(self._run(live, adm.input, started=slot), name=f"job:{adm.action_id}")
        self._tasks[adm.action_id] = task
        task.add_done_callback(partial(self._forget_task, adm.action_id))
        if slot:  # the task's end frees the slot, even a task cancelled before its first step
            task.add_done_callback(lambda _task: self._semaphore.release())
        self.metrics.inc("jobs_admitted_total", operation=adm.operation)
        log.info(
            "job_admitted",
            action_id=adm.action_id,
            crew_id=adm.crew_id,
            operation=adm.operation,
            input_bytes=adm.input_bytes,
            timeout_ms=adm.timeout_ms,
            request_hash=adm.request_hash[:16],
        )

    # ------------------------------------------------------------ execution

    async def _run(self, live: LiveJob, input: dict[str, Any], *, started: bool = False) -> None:
        """Run an admitted job: ``started``, its slot and start were taken at admission; else wait for a
        slot and commit its start (`queued` → `running`)."""
        if started:
            if not live.closed:  # a cancel can come between the admission and this step
                live.notify()
                await self._execute(live, input)
            return
        async with self._semaphore:
            async with live.flush_lock:  # serialized with a concurrent cancel's terminal commit
                if live.closed or self._closing:  # shutting down: a queued job never starts (shutdown cancels it)
                    return
                try:
                    ok = await self.journal.transition(
                        live.action_id, JobStatus.RUNNING, first_sequence=0, events=[_started(live.operation)]
                    )
                except JournalWriteFailed:
                    ok = None
                if ok:
                    live.status, live.committed, live.next_sequence = JobStatus.RUNNING, 1, 1
            if ok is None:
                log.error("job_start_not_recorded", action_id=live.action_id)
                if live.close():  # CrewAI never started: the outcome is certain
                    await self.terminals.fail(
                        live, "JournalWriteFailed", "the sidecar could not record the job's start", False
                    )
                return
            if not ok or live.closed:
                return
            live.notify()
            await self._execute(live, input)

    async def _execute(self, live: LiveJob, input: dict[str, Any]) -> None:
        """Run the job under its ``aip.sidecar.job`` span (docs/observing.md "Observing actions")."""
        with job_span(live.action_id, live.crew_id, live.operation) as span:
            try:
                await self._execute_traced(live, input)
            finally:
                if live.ctx is not None and live.ctx.spans is not None:
                    live.ctx.spans.close()
                end_job(span, live.status.value)

    async def _execute_traced(self, live: LiveJob, input: dict[str, Any]) -> None:
        ctx = JobContext(
            action_id=live.action_id,
            crew_id=live.crew_id,
            operation=live.operation,
            tenant=live.tenant,
            emit_chunk=partial(self._emit_chunk, live),
            cancel_flag=live.cancel_flag,
            state_dir=self._state_dir,
            training_dir=self.settings.training_dir,
            find_task_run=partial(self._find_task_run, live.crew_id, live.tenant),
            note_dropped=partial(self._note_dropped, live),
            traceparent=current_traceparent(),
            spans=crew_spans(current_traceparent(), job_attributes(live.action_id, live.crew_id, live.operation)),
        )
        live.ctx = ctx
        started_at = time.monotonic()
        log.info("job_started", action_id=live.action_id, operation=live.operation)
        live.exec_task = asyncio.create_task(
            self._executor(live.crew_id, live.operation, input, ctx), name=f"exec:{live.action_id}"
        )
        self._background.add(live.exec_task)
        live.exec_task.add_done_callback(self._background.discard)
        done, _ = await asyncio.wait({live.exec_task}, timeout=live.timeout_ms / 1000)
        if not done and live.close():
            log.warning("job_timed_out", action_id=live.action_id, timeout_ms=live.timeout_ms)
            self._signal_stop(live)
            await asyncio.shield(
                self.terminals.fail(
                    live,
                    "ExecutionTimeout",
                    f"the job exceeded its execution bound of {live.timeout_ms} ms",
                    live.spec.mutation,
                )
            )
        await asyncio.wait({live.exec_task})  # hold the slot until the worker really returns
        duration_ms = int((time.monotonic() - started_at) * 1000)
        if live.close():
            await asyncio.shield(self.terminals.record_outcome(live, live.exec_task, duration_ms))
        else:
            observed = _stop_observed(live.exec_task, ctx)
            try:
                await self.journal.set_provider_stop_observed(live.action_id, observed)
            except JournalWriteFailed:
                log.error("job_stop_not_recorded", action_id=live.action_id)
            log.info(
                "job_worker_returned",
                action_id=live.action_id,
                provider_stop_observed=observed,
                duration_ms=duration_ms,
            )

    def _signal_stop(self, live: LiveJob, *, force: bool = False) -> None:
        """Set the cooperative flag; cancel the asyncio task where that stops CrewAI."""
        live.cancel_flag.set()
        if live.exec_task is not None and (force or self._stops_by_task or live.operation in TASK_CANCELLED_OPERATIONS):
            live.exec_task.cancel()

    # ---------------------------------------------------------------- chunks

    def _emit_chunk(self, live: LiveJob, data: dict[str, Any]) -> None:
        """``ctx.emit_chunk``: safe from any thread, never raises."""
        try:
            if threading.get_ident() == self._loop_thread:
                self._accept_chunk(live, data)
            else:
                self._loop.call_soon_threadsafe(self._accept_chunk, live, data)
        except Exception as exc:  # a closed loop at shutdown: the chunk is lost, never raised into CrewAI
            log.debug("chunk_not_accepted", action_id=live.action_id, error_type=type(exc).__name__)

    def _note_dropped(self, live: LiveJob, count: int) -> None:
        """``ctx.note_dropped``: chunks a worker process dropped itself at the per-job bound (event loop only)."""
        live.dropped += max(0, count)

    def _accept_chunk(self, live: LiveJob, data: dict[str, Any]) -> None:
        if live.closed or live.status is not JobStatus.RUNNING:
            return
        if live.next_sequence >= self.settings.max_events_per_run - 1:
            live.dropped += 1  # the last slot is reserved for the terminal event
            return
        row = chunk_row(live.next_sequence, data, self.settings.max_event_bytes)
        if row is None:
            return
        live.pending.append(row)
        live.next_sequence += 1
        self.metrics.inc("chunks_total")
        live.notify()
        if (
            len(live.pending) >= self.settings.stream_checkpoint_events + live.checkpoint_backoff
            and not live.flush_scheduled
        ):
            live.flush_scheduled = True
            task = asyncio.create_task(self._checkpoint(live))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _checkpoint(self, live: LiveJob) -> None:
        async with live.flush_lock:
            live.flush_scheduled = False
            if live.closed or not live.pending:
                return  # the terminal transaction commits what is pending
            batch = list(live.pending)
            try:
                ok = await self.journal.append_events(live.action_id, live.committed, batch)
            except JournalWriteFailed:
                self.metrics.inc("journal_write_failures_total")
                log.error("job_checkpoint_failed", action_id=live.action_id, events=len(batch))
                live.checkpoint_backoff = len(batch)  # retry after another checkpoint's worth, not at every chunk
                return  # kept pending: the next checkpoint or the terminal event retries
            if ok:
                del live.pending[: len(batch)]
                live.committed += len(batch)
                live.checkpoint_backoff = 0

    async def _find_task_run(self, crew_id: str, tenant: str, task_id: str) -> dict[str, Any] | None:
        """``ctx.find_task_run``: the retained run (or batch item) holding ``task_id``, with the
        ``fingerprint`` and ``inputs`` kept with it when there are any."""
        hit = await self.journal.find_task_run_hit(crew_id, task_id, tenant)
        if hit is None:
            return None
        raw, action_id, index = hit
        run: dict[str, Any] = msgspec.json.decode(raw)
        inputs = await asyncio.to_thread(self.replay_inputs.read, action_id, index)
        if inputs is not None:
            run["inputs"] = inputs
        return run

    # ------------------------------------------------------- cancel / archive

    async def cancel(self, action_id: str, crew_id: str) -> dict[str, Any]:
        """Cancel a queued or running job; idempotent on terminal jobs.

        Raises JobNotFound (unknown, archived, or another crew's), JobNotCancellable (409).
        """
        record, live = await self.reads.record(action_id)
        if record.crew_id != crew_id:
            raise JobNotFound(f"job {action_id!r} not found for crew {crew_id!r}")
        if live is not None and not live.closed:
            if not live.spec.cancel:
                raise JobNotCancellable(f"{live.operation} jobs cannot be cancelled")
            live.close()
            queued = live.exec_task is None
            self._signal_stop(live)
            log.info("job_cancel_requested", action_id=action_id, operation=live.operation)
            await asyncio.shield(self.terminals.finish(live, JobStatus.CANCELLED, {"status": "cancelled"}))
            if queued:  # CrewAI never started: the stop is certain
                await self.journal.set_provider_stop_observed(action_id, True)
        elif live is not None:
            await live.finished.wait()  # another outcome is being committed right now
        return await self.reads.view(action_id)

    async def archive(self, action_id: str) -> dict[str, Any]:
        """Archive a terminal job. Raises JobNotFound, JobStillRunning (409)."""
        live = self._live.get(action_id)
        if live is not None:
            raise JobStillRunning(f"job {action_id!r} is {live.status.value}; archive it once terminal")
        outcome = await self.journal.archive(action_id)
        if outcome is ArchiveOutcome.NOT_FOUND:
            raise JobNotFound(f"job {action_id!r} not found")
        if outcome is ArchiveOutcome.NOT_TERMINAL:
            raise JobStillRunning(f"job {action_id!r} is not terminal")
        await asyncio.to_thread(self.replay_inputs.remove, action_id)
        log.info("job_archived", action_id=action_id, already=outcome is ArchiveOutcome.ALREADY_ARCHIVED)
        return {"action_id": action_id, "archived": True}

    # ---------------------------------------------------------- health / stop

    def health(self) -> dict[str, Any]:
        """``GET /health`` body (ARCHITECTURE.md §4)."""
        s = self.settings
        return {
            "status": "stopping"
            if self._closing
            else "draining"
            if self._draining
            else "degraded"
            if self._degraded()
            else "ready",
            "crews": sorted(self.crews),
            "active_runs": sum(1 for live in self._live.values() if not live.closed),
            "retained_runs": self.journal.retained_runs,
            "max_retained_runs": s.max_retained_runs,
            "durable_journal": not s.ephemeral,
            "stream_checkpoint_events": s.stream_checkpoint_events,
            "operations": s.operations,
            "training_directory": s.training_dir is not None,
            "crew_problems": self.crew_problems,
            "crew_inputs": self.crew_inputs,
            "sse_keepalive_seconds": s.sse_keepalive_seconds,
            "cancellable_operations": sorted(op for op in s.operations if operation_spec(op).cancel),
            "worker_sandbox": msgspec.to_builtins(
                sandbox_report(isolation=s.isolation, sandbox=s.worker_sandbox, euid=os.geteuid())
            ),
        }

    def _degraded(self) -> bool:
        """Outcomes wait to be recorded, the journal was replaced, or an admission write failed
        less than :data:`RECENT_WRITE_FAILURE_SECONDS` ago with no successful admission since."""
        failed_at = self._admission_write_failed_at
        recent = failed_at is not None and time.monotonic() - failed_at < RECENT_WRITE_FAILURE_SECONDS
        return bool(len(self.backlog)) or not self.journal.still_at_path() or recent

    def render_metrics(self, gauges: Mapping[str, int] | None = None) -> str:
        """``GET /metrics`` body (Prometheus text, see :mod:`metrics`), with the HTTP layer's ``gauges``."""
        return self.metrics.render(
            {
                "active_runs": sum(1 for live in self._live.values() if not live.closed),
                "retained_runs": self.journal.retained_runs,
                "max_retained_runs": self.settings.max_retained_runs,
                **(gauges or {}),
            }
        )

    async def drain(self) -> None:
        """Stop admitting new jobs (503 ``sidecar.draining`` before admission: a host places the job on
        another sidecar of its crew, or retries it) while repeats of admitted ones are still answered, and
        return once every admitted job has ended, however long that takes (a rolling upgrade loses no run;
        a SIGTERM meanwhile still stops with its grace). docs/operating.md "Draining a sidecar"."""
        self._draining = True
        while pending := [t for t in self._tasks.values() if not t.done()]:
            await asyncio.wait(pending)

    async def shutdown(self, grace_seconds: float) -> None:
        """Stop admitting (503), let jobs finish within ``grace_seconds``, then
        cancel the rest with a terminal ``cancelled`` event (reason
        ``sidecar_shutdown``). A killed process leaves them ``running``
        instead; the next start fails them as uncertain."""
        self._closing = True
        pending = [t for t in self._tasks.values() if not t.done()]
        if pending and grace_seconds > 0:
            await asyncio.wait(pending, timeout=grace_seconds)
        for live in list(self._live.values()):
            if live.close():
                self._signal_stop(live, force=True)
                await self.terminals.finish(
                    live, JobStatus.CANCELLED, {"status": "cancelled", "reason": "sidecar_shutdown"}
                )
                if live.exec_task is None:  # CrewAI never started: the stop is certain (as cancel())
                    await self.journal.set_provider_stop_observed(live.action_id, True)
                log.warning("job_cancelled_at_shutdown", action_id=live.action_id)
        tasks = [t for t in [*self._tasks.values(), *self._background] if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        if len(self.backlog):
            await self.backlog.flush()  # a last try; what stays is fenced at the next start
        await self.backlog.close()


def _stop_observed(task: asyncio.Task[Any], ctx: JobContext) -> bool:
    """Whether a stopped job's worker returned because of the stop."""
    if task.cancelled() or ctx.stop_observed:
        return True
    return isinstance(task.exception(), JobCancelled)


def _started(operation: str) -> EventRow:
    """A job's event 0 (ARCHITECTURE.md §4, events)."""
    return event_row(0, "started", {"status": "running", "operation": operation})
