"""Execute one admitted action against the sidecar and produce its AIP result.

This module knows the operation catalogue's sidecar bindings and the result
and cancellation mapping of ARCHITECTURE.md §8; it knows nothing of HTTP requests
from tenants, fences or the store (chunks leave through ``on_chunks``).

Source: ARCHITECTURE.md §4 (routes), §8 (normalization, cancellation, errors).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from ...contracts.aip import ActionResult, StreamChunk
from ...contracts.errors import (
    ConnectorCancelledUnconfirmed,
    ConnectorError,
    ConnectorInvalidStream,
    ConnectorRemoteTemporary,
    ConnectorResponseTooLarge,
    ConnectorStreamSilent,
    ConnectorTransport,
    NotCancellable,
)
from ...contracts.operations import OperationSpec
from ...contracts.sidecar import JobEvent
from ..sidecars.client import TASK_RUN_NOT_FOUND, DispatchProgress, SidecarClient, not_admitted, sidecar_job_id
from ..sidecars.placement import Placement
from ..tracing import TraceRef
from .lifecycle import DispatchState
from .normalize import MAX_STREAM_EVENTS, StreamNormalizer, failed_result, result_from_terminal

log = structlog.get_logger(__name__)

OnChunks = Callable[[list[StreamChunk]], Awaitable[None]]
#: (tenant, action id) -> the name of the sidecar the action's job is placed on (None: not placed).
Locate = Callable[[str, str], Awaitable[str | None]]
#: ``await_start(tenant, action_id)``: returns once that run's start was answered by its sidecar, it left
#: ``running``, or a bound passed, with the run's placement as then stored (:func:`.dispatch_task.await_target_start`).
AwaitStart = Callable[[str, str], Awaitable[str | None]]
#: Failures after which the job may be running at the sidecar and is not followed any more: cancel it
#: (ARCHITECTURE.md §8). A broken read is resumed from the journal first (:meth:`Dispatcher._follow`).
_STREAM_FAILURES = (ConnectorInvalidStream, ConnectorResponseTooLarge, ConnectorTransport)
#: Times an invalid stream of one job is read again from the sidecar's journal before the action fails.
MAX_INVALID_REREADS = 3
#: Delays between reads of a job view that cannot connect, seconds (the last one repeats).
RESUME_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)
#: How long a broken stream's job view is retried before the action is left to the reconciler, seconds.
READ_RETRY_BUDGET_S = 10.0


class StartNotAdmitted(Exception):
    """A start the sidecar provably did not admit (:func:`.sidecar_client.not_admitted`):
    nothing ran; the caller places it on another ready sidecar of the crew at once, or
    retries it under the same job id and idempotency key until its dispatch deadline
    (ARCHITECTURE.md §9, docs/operating.md "Several sidecars"). ``error``: the refusal.
    ``elsewhere_only``: a ``replay`` whose task run this sidecar does not hold (422
    ``sidecar.task_run_not_found``): only another sidecar of the crew may hold it; when
    none is left, the refusal is the result."""

    def __init__(self, error: ConnectorError, *, elsewhere_only: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.elsewhere_only = elsewhere_only


class DispatchDeferred(Exception):
    """The job's event stream went silent and the job view cannot be read
    either (a frozen or unreachable sidecar): the action stays running and the
    periodic reconciler follows it again (ARCHITECTURE.md §8). ``error``: the
    last failure."""

    def __init__(self, error: ConnectorError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class Job:
    """One action as the dispatcher sees it.

    ``input`` is the validated input as sent by the tenant (a dict);
    ``target_action_id`` is the run an inspection operation (status, events,
    cancel) points at, already checked to belong to the same tenant and crew.
    ``durable`` says whether the host store fsyncs the action's own writes
    (see ``actions.durable_action``). ``sidecar``: the name of the sidecar the
    job is placed on (None: not placed yet, or a row from before placements:
    the crew's first sidecar); ``target_sidecar``: the target run's placement
    (read from the store by the dispatcher when None). docs/operating.md "Several sidecars".
    """

    tenant: str
    action_id: str
    crew_id: str
    spec: OperationSpec
    input: dict[str, Any]
    idempotency_key: str
    timeout_ms: int | None = None
    stream: bool = False
    first_chunk_sequence: int = 0
    durable: bool = True
    dispatch: DispatchProgress = field(default_factory=DispatchProgress)
    #: the stored action's trace context, continued by the dispatch (:mod:`..tracing`)
    trace: TraceRef | None = None
    sidecar: str | None = None
    target_sidecar: str | None = None

    @property
    def job_id(self) -> str:
        return sidecar_job_id(self.tenant, self.action_id)

    @property
    def target_job_id(self) -> str:
        return sidecar_job_id(self.tenant, str(self.input["run_action_id"]))


def host_may_answer(job: Job) -> bool:
    """Whether the host answers ``job`` itself when the sidecar does not know its run (a 404): a ``status`` or an
    ``events`` page, not a streamed ``events`` (:func:`.dispatch_task.answer_before_admission`; ARCHITECTURE.md §9)."""
    return job.spec.name == "status" or (job.spec.name == "events" and not job.stream)


class Dispatcher:
    """Runs jobs on the sidecars.

    Args:
        client: the client of a sidecar not named in ``clients`` (a one-sidecar host).
        max_response_bytes: bound on one streamed response, bytes.
        clients: sidecar name -> its client (``[[sidecars]]``, ARCHITECTURE.md §10).
        placement: the crews' sidecars and their load (default: every crew on every named
            sidecar, or on ``client`` alone).
        locate: the placement of a stored action (the target run of ``status``, ``events`` and
            ``cancel``); default: none known (the crew's first sidecar).
        await_start: waits for a target run's start to be answered before its ``events`` are asked
            for (an ``:events`` sent right after the run's approval must not reach the sidecar before
            the run's own start), returning the run's placement (read once: it replaces ``locate``'s read,
            and a run placed when its start was sent is found on its sidecar); default: no wait.
        max_events: bound on the events of one job's stream (ARCHITECTURE.md §7 "stream"), live or
            read back from the journal.
    """

    def __init__(
        self,
        client: SidecarClient,
        *,
        max_response_bytes: int,
        clients: Mapping[str, SidecarClient] | None = None,
        placement: Placement | None = None,
        locate: Locate | None = None,
        max_events: int = MAX_STREAM_EVENTS,
        await_start: AwaitStart | None = None,
    ) -> None:
        self.client = client
        self.max_response_bytes = max_response_bytes
        self.max_events = max_events
        self.clients = dict(clients or {})
        self.placement = placement or Placement([(name, None) for name in self.clients] or [("sidecar", None)])
        self.locate = locate
        self.await_start = await_start

    def client_for(self, job: Job, *, target: bool = False) -> SidecarClient:
        """The client of the sidecar holding ``job`` (``target``: the run it inspects): its recorded
        placement, else the crew's first sidecar (:meth:`.Placement.home`)."""
        name = job.target_sidecar if target else job.sidecar
        if not name or name not in self.clients:  # not placed, placed before placements (''), or renamed since
            name = self.placement.home(job.crew_id)
        return self.clients.get(name, self.client)

    async def _locate_target(self, job: Job) -> SidecarClient:
        """The client of the sidecar holding the run ``job`` inspects (its placement, read once; not read
        when the host has one sidecar, which holds every run: a ``status`` costs no store read before its
        hop, and a 404 from a run admitted meanwhile is asked again, :func:`.dispatch_task.answer_before_admission`)."""
        if job.target_sidecar is None and self.locate is not None and len(self.clients) > 1:
            job.target_sidecar = await self.locate(job.tenant, str(job.input["run_action_id"]))
        return self.client_for(job, target=True)

    def _normalizer(self, job: Job, start_sequence: int = 0) -> StreamNormalizer:
        return StreamNormalizer(
            job.action_id,
            job.spec,
            start_sequence=start_sequence,
            first_chunk_sequence=job.first_chunk_sequence,
            max_response_bytes=self.max_response_bytes,
            max_events=self.max_events,
        )

    async def run(self, job: Job, on_chunks: OnChunks) -> ActionResult:
        """Execute ``job``; never raises a ConnectorError (it becomes a failed
        result whose ``dispatch`` says how far the request got).

        Raises:
            StartNotAdmitted: a start (a startable operation) the sidecar
                provably did not admit; the caller retries it.
            DispatchDeferred: a silent stream whose job cannot be read now.
        """
        try:
            return await self._run(job, on_chunks)
        except ConnectorError as exc:
            # Only the start request's own refusal: a read after an answered start (the job view of a
            # blocking start, a full output) that cannot connect says nothing about admission.
            if (
                job.spec.startable
                and not_admitted(exc)
                and (exc.details.get("admitted") is False or job.dispatch.state == DispatchState.NOT_SENT)
            ):
                raise StartNotAdmitted(exc) from exc
            if job.spec.name == "replay" and exc.details.get("remote_code") == TASK_RUN_NOT_FOUND:
                raise StartNotAdmitted(exc, elsewhere_only=True) from exc  # refused before admission
            if (
                job.spec.stream
                and job.spec.cancel
                and isinstance(exc, _STREAM_FAILURES)
                and job.dispatch.state != DispatchState.NOT_SENT
            ):
                exc = await self._cancel_after_failure(job, exc)
            if host_may_answer(job) and exc.details.get("remote_status") == 404:
                # Most often a run not admitted yet (pending approval, its start on the way): the host's own view
                # answers it (dispatch_task.answer_before_admission, which warns when the 404 stands).
                log.info("read_unknown_to_sidecar", code=exc.code, operation=job.spec.name)
            else:
                log.warning("dispatch_failed", code=exc.code, operation=job.spec.name, dispatch=job.dispatch.state)
            return failed_result(job.action_id, exc)

    async def _run(self, job: Job, on_chunks: OnChunks) -> ActionResult:
        spec, client = job.spec, self.client_for(job)
        if not spec.startable:  # status, events, cancel: to the sidecar holding the run they name
            if spec.name == "events" and self.await_start is not None:  # its placement, once its start is answered
                job.target_sidecar = await self.await_start(job.tenant, str(job.input["run_action_id"]))
            client = await self._locate_target(job)
        if spec.name == "status":
            view = await client.get_job(spec, job.dispatch, job_id=job.target_job_id)
            return self._completed(job, _public_view(view, job))
        if spec.name == "cancel":
            view = await client.cancel(
                spec,
                job.dispatch,
                job_id=job.target_job_id,
                crew_id=job.crew_id,
                reason=job.input.get("reason"),
            )
            return self._completed(job, _public_view(view, job))
        if spec.name == "events":
            cursor = int(job.input.get("cursor") or 0)
            if not job.stream:
                page = await client.get_events(
                    spec,
                    job.dispatch,
                    job_id=job.target_job_id,
                    cursor=cursor,
                )
                return self._completed(job, _public_view(page, job))
            normalizer = self._normalizer(job, cursor)
            terminal = await self._follow(
                job,
                job.target_job_id,
                normalizer,
                on_chunks,
                client.stream(
                    spec,
                    job.dispatch,
                    normalizer,
                    on_chunks,
                    method="GET",
                    path=spec.stream_path.format(run_action_id=job.target_job_id),  # type: ignore[union-attr]
                    action_id=job.target_job_id,
                    params={"cursor": cursor},  # the header names the sidecar job
                ),
            )
            return self._completed(
                job,
                {
                    "run_action_id": job.input["run_action_id"],
                    "status": terminal.event,
                    "next_cursor": terminal.sequence + 1,
                },
            )
        if spec.stream:
            normalizer = self._normalizer(job)
            terminal = await self._follow(
                job,
                job.job_id,
                normalizer,
                on_chunks,
                client.start_stream(
                    spec,
                    job.dispatch,
                    normalizer,
                    on_chunks,
                    job_id=job.job_id,
                    crew_id=job.crew_id,
                    input=job.input,
                    idempotency_key=job.idempotency_key,
                    timeout_ms=job.timeout_ms,
                ),
            )
            return result_from_terminal(job.action_id, spec, await self._with_full_output(job, terminal))
        status, body = await client.start_job(
            spec,
            job.dispatch,
            job_id=job.job_id,
            crew_id=job.crew_id,
            input=job.input,
            idempotency_key=job.idempotency_key,
            timeout_ms=job.timeout_ms,
        )
        if status == 200:
            return self._completed(job, body)
        return await self._settle_blocking(job, status)

    async def _follow(
        self, job: Job, job_id: str, normalizer: StreamNormalizer, on_chunks: OnChunks, first: Awaitable[JobEvent]
    ) -> JobEvent:
        """Await ``first`` (a stream of job ``job_id`` fed to ``normalizer``)
        to its terminal event. The sidecar's journal holds every event, so a
        read that breaks is resumed, never a reason to cancel (ARCHITECTURE.md
        §8): when the stream goes silent (:class:`ConnectorStreamSilent`), its
        connection fails (:class:`ConnectorTransport`, once the request may
        have reached the sidecar) or it turns invalid (:class:`ConnectorInvalidStream`:
        a gap, a repeat, no terminal event; at most :data:`MAX_INVALID_REREADS`
        times), read the job view (``GET /jobs/{id}``, retried with backoff for
        :data:`READ_RETRY_BUDGET_S` while it cannot connect) and follow the
        job's events again from the first one not delivered. Every chunk
        before the break was delivered (:meth:`StreamNormalizer.feed`), so the
        action's chunks stay whole and in order. A view whose journal ended before the first event not
        delivered (:func:`journal_lost_tail`: a sidecar killed lost streamed events it had not committed,
        and journaled its restart failure at a sequence already delivered) settles on the job's
        terminal event (:meth:`terminal_event`) instead: reading on would find a gap, or nothing.

        Raises:
            DispatchDeferred: the view cannot be read (frozen or gone sidecar):
                the reconciler follows the job later.
            StartNotAdmitted: a broken start whose job the sidecar does not know (404).
            ConnectorError: any other failure of a stream (a start refused, a
                response over its bound, a stream invalid once more than allowed).
        """
        stream, invalid, cause = first, 0, None
        while True:
            try:
                return await stream
            except ConnectorStreamSilent as exc:
                failure: ConnectorError = exc
            except ConnectorTransport as exc:
                if cause is None and job.dispatch.state == DispatchState.NOT_SENT:
                    raise  # the request never left: run() retries a start (StartNotAdmitted), a read fails retryable
                failure = exc
            except ConnectorInvalidStream as exc:
                invalid += 1
                if normalizer.terminal is not None or invalid > MAX_INVALID_REREADS:
                    raise  # events after the terminal one (a broken peer), or a journal invalid on every read
                failure = exc
            except ConnectorError:
                if cause is None:
                    raise
                raise cause from None  # the journal cannot be read again (refused, gone): the first failure stands
            cause = cause or failure
            log.warning(
                "sidecar_stream_silent" if isinstance(failure, ConnectorStreamSilent) else "sidecar_stream_resumed",
                job_id=job_id,
                code=failure.code,
                next_sequence=normalizer.expected,
                silence_s=failure.details.get("silence_seconds"),
            )
            view = await self._view_before_resume(job, job_id, cause)
            job.dispatch.state = DispatchState.ACKNOWLEDGED  # the sidecar knows the job
            if job_id == job.job_id and journal_lost_tail(view, normalizer.expected):
                terminal = await self.terminal_event(job)
                if terminal is not None:  # the journal's last word, at a sequence the tenant already has
                    log.warning("sidecar_journal_lost_events", job_id=job_id, next_sequence=normalizer.expected)
                    return terminal
            normalizer = normalizer.resumed()
            stream = self.client_for(job, target=job_id != job.job_id).stream(
                job.spec,
                DispatchProgress(),
                normalizer,
                on_chunks,
                method="GET",
                path=f"/jobs/{job_id}/events",
                action_id=job_id,
                params={"cursor": normalizer.expected},
            )

    async def _view_before_resume(self, job: Job, job_id: str, cause: ConnectorError) -> Any:
        """Read job ``job_id``'s view before following its events again; a
        view that cannot connect, or that the sidecar answers "try later" (429,
        5xx: :class:`ConnectorRemoteTemporary`, e.g. 503 when overloaded), is
        retried with backoff (:data:`RESUME_BACKOFF_S`) for at most
        :data:`READ_RETRY_BUDGET_S` seconds.

        Raises:
            StartNotAdmitted: the sidecar does not know ``job``'s own start,
                which it never answered (404).
            ConnectorError: ``cause`` (the stream's first failure) for a job
                the sidecar answered for and now does not know (404); the
                view's own error for any other answer.
            DispatchDeferred: no usable answer within the budget.

        Returns the job view (a JSON object)."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + READ_RETRY_BUDGET_S
        attempt = 0
        while True:
            try:
                return await self.client_for(job, target=job_id != job.job_id).get_job(
                    job.spec, DispatchProgress(), job_id=job_id
                )
            except ConnectorError as exc:
                if exc.remote_status == 404:
                    own_start = job_id == job.job_id and job.spec.startable
                    if own_start and job.dispatch.state != DispatchState.ACKNOWLEDGED:
                        exc.details.update(admitted=False, uncertain_outcome=False)  # the start never became a job
                        raise StartNotAdmitted(exc) from exc
                    raise cause from exc
                if exc.remote_status is not None and not isinstance(exc, ConnectorRemoteTemporary):
                    raise
                # No connection, or a "try later" (429, 5xx: a sidecar overloaded or restarting) says nothing
                # about the job, whose journal holds every event: wait and read it again, never a cancel.
                delay_s = RESUME_BACKOFF_S[min(attempt, len(RESUME_BACKOFF_S) - 1)]
                if loop.time() + delay_s > give_up_at:  # no answer: leave the action running for the reconciler
                    raise DispatchDeferred(exc) from exc
                await asyncio.sleep(delay_s)
                attempt += 1

    def _completed(self, job: Job, output: Any) -> ActionResult:
        return ActionResult(action_id=job.action_id, status="completed", output=output)

    async def _settle_blocking(self, job: Job, status: int) -> ActionResult:
        """A blocking start answered 409/502/504: read the job's terminal event."""
        terminal = await self.terminal_event(job)
        if terminal is not None:
            return result_from_terminal(job.action_id, job.spec, terminal)
        raise ConnectorRemoteTemporary(
            "the sidecar is still running the job after the wait timed out",
            operation=job.spec.name,
            remote_status=status,
            uncertain_outcome=job.spec.mutation,
            read_only=job.spec.read_only,
            dispatch="acknowledged",
        )

    async def terminal_event(self, job: Job) -> JobEvent | None:
        """The job's terminal sidecar event, or None while it runs (used for
        blocking starts and to reconcile actions after a host restart)."""
        view = await self.client_for(job).get_job(job.spec, DispatchProgress(), job_id=job.job_id)
        count = int(view.get("event_count") or 0)
        if view.get("status") not in ("completed", "failed", "cancelled") or count == 0:
            return None
        page = await self.client_for(job).get_events(
            job.spec,
            DispatchProgress(),
            job_id=job.job_id,
            cursor=count - 1,
        )
        events = page.get("events") or []
        if not events:
            return None
        last = events[-1]
        terminal = JobEvent(event=str(last["event"]), sequence=int(last["sequence"]), data=dict(last.get("data") or {}))
        return await self._with_full_output(job, terminal)

    async def resume(self, job: Job, on_chunks: OnChunks) -> ActionResult:
        """Re-attach to a streamed job this process did not start (a host restart):
        follow its journaled events (``GET /jobs/{id}/events`` as SSE, read-only:
        never a new start) from the last chunk the store holds, which is read
        again so a stored terminal event is seen (the store skips sequences it
        has), live to the terminal event. AIP chunk sequences equal sidecar
        sequences for streamed starts, so ``job.first_chunk_sequence`` (the
        stored chunk count) is the cursor. With ``first_chunk_sequence`` 0, the job's whole
        stream is read back (a result settled from the journal backfills it: ``recovery.from_journal``).

        A 416 (the sidecar lost events it had streamed but not journaled
        before a crash of its own) falls back to the job's terminal event.

        Raises:
            ConnectorError: the sidecar cannot be read (404: it never
                admitted the job), or the job still runs after a 416.
            DispatchDeferred: the stream went silent and the job view cannot be read.
            StartNotAdmitted: the stream went silent and the sidecar does not know the job.
        """
        cursor = max(job.first_chunk_sequence - 1, 0)
        normalizer = StreamNormalizer(
            job.action_id,
            job.spec,
            start_sequence=cursor,
            first_chunk_sequence=cursor,
            max_response_bytes=self.max_response_bytes,
            max_events=self.max_events,
        )
        try:
            terminal = await self._follow(
                job,
                job.job_id,
                normalizer,
                on_chunks,
                self.client_for(job).stream(
                    job.spec,
                    job.dispatch,
                    normalizer,
                    on_chunks,
                    method="GET",
                    path=f"/jobs/{job.job_id}/events",
                    action_id=job.job_id,
                    params={"cursor": cursor},
                ),
            )
        except ConnectorError as exc:
            if exc.remote_status != 416:
                raise
            found = await self.terminal_event(job)
            if found is None:
                raise
            return result_from_terminal(job.action_id, job.spec, found)
        return result_from_terminal(job.action_id, job.spec, await self._with_full_output(job, terminal))

    async def _with_full_output(self, job: Job, terminal: JobEvent) -> JobEvent:
        """A ``completed`` event too large for one event carries
        ``output_omitted: true``; the whole output (at most 4 MiB) is on the
        job view, so read it there (sidecar contract, ARCHITECTURE.md §4)."""
        if terminal.event != "completed" or not terminal.data.get("output_omitted"):
            return terminal
        view = await self.client_for(job).get_job(job.spec, DispatchProgress(), job_id=job.job_id)
        output = view.get("output")
        return JobEvent(
            event="completed",
            sequence=terminal.sequence,
            data=output if isinstance(output, dict) else {"output": output},
        )

    async def _cancel_after_failure(self, job: Job, error: ConnectorError) -> ConnectorError:
        """After a stream failure on a cancellable operation, ask the sidecar to
        cancel (ARCHITECTURE.md §8); an unconfirmed cancel becomes cancelled_unconfirmed."""
        try:
            await self.client_for(job).cancel(
                job.spec,
                DispatchProgress(),
                job_id=job.job_id,
                crew_id=job.crew_id,
                reason="host stream failure",
            )
        except ConnectorError:
            return ConnectorCancelledUnconfirmed(
                operation=job.spec.name,
                remote_status=error.remote_status,
                uncertain_outcome=True,
                dispatch=job.dispatch.state,
                details={"cause": error.code},
            )
        error.details["cancel_confirmed"] = True
        return error

    async def cancel_remote(self, job: Job) -> tuple[bool, dict[str, Any] | None]:
        """Request a stop of a running job; returns (confirmed, job view), and when the sidecar did not
        answer the cancel, (False, ``{"remote_status": status or None}``): 404 is a job it does not know.

        Raises:
            NotCancellable: the sidecar answered 409 (a peer sidecar cancels
                only ``run`` and ``batch_run``): the job keeps running and the
                host keeps following it (ARCHITECTURE.md §8: a silent stream is never a cancel).
        """
        try:
            view = await self.client_for(job).cancel(
                job.spec,
                DispatchProgress(),
                job_id=job.job_id,
                crew_id=job.crew_id,
                reason="cancelled by the tenant",
            )
        except ConnectorError as exc:
            if exc.remote_status == 409:
                raise NotCancellable(
                    message="the sidecar cannot cancel this operation; the action keeps running",
                    details={"operation": job.spec.name},
                ) from exc
            return False, {"remote_status": exc.remote_status}
        return view.get("status") in ("cancelled", "completed", "failed"), view


def journal_lost_tail(view: Any, expected: int) -> bool:
    """Whether a sidecar job view (``GET /jobs/{id}``: ``status``, ``event_count``) shows a journal that lost
    events a reader was sent: the job ended, and its journal holds no event at or after ``expected`` (the
    first sequence the reader has not had), although the reader never saw the terminal event. The sidecar
    streams chunks before it commits them (at most ``stream_checkpoint_events`` at a time); killed, it
    loses them and journals the restart failure (``uncertain_outcome: true``) at the next committed
    sequence (ARCHITECTURE.md §5, restart). Pure."""
    if not isinstance(view, dict) or view.get("status") not in ("completed", "failed", "cancelled"):
        return False
    count = view.get("event_count")
    return isinstance(count, int) and 0 < count <= expected


def _public_view(value: Any, job: Job) -> Any:
    """Present sidecar views under the tenant's action ids, not the sidecar's
    tenant-prefixed job ids."""
    if isinstance(value, dict) and "action_id" in value:
        value = {**value, "action_id": job.input.get("run_action_id", job.action_id)}
    return value
