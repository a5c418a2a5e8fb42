"""The background dispatch task of a running action: its lease, the re-check of a governed action's
approval, the start retried while the sidecar provably did not admit it (until the dispatch deadline),
its chunks and its one final write. Functions over an :class:`~.writer.ActionRuntime`, as
:mod:`.cancellation` and :mod:`.recovery` are.

Source: ARCHITECTURE.md §9 ("Dispatch retries", "Action states"), §10 (dispatch leases).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog

from ...contracts.aip import ActionResult
from ...contracts.errors import AipError, ConnectorDispatchDeadline
from ..sidecars.client import DispatchProgress
from ..store.records import LeaseLost, StoreUnavailable
from ..tracing import dispatching, record_outcome
from .chunk_sink import ChunkSink
from .dispatch import DispatchDeferred, Job, OnChunks, StartNotAdmitted, host_may_answer
from .lifecycle import ActionState, DispatchState
from .live import LiveAction
from .normalize import failed_result
from .writer import ActionRuntime

if TYPE_CHECKING:
    from ..store.store import Store

__all__ = [
    "run",
    "saw_lease_lost",
    "answer_before_admission",
    "no_chunks",
    "await_target_start",
    "TARGET_START_WAIT_S",
    "retry_delay_s",
    "RETRY_FIRST_S",
    "RETRY_MAX_S",
]

log = structlog.get_logger(__name__)

#: Backoff between retries of a start the sidecar did not admit: first wait and cap, seconds (ARCHITECTURE.md §9).
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0


def retry_delay_s(attempt: int) -> float:
    """The wait before retry ``attempt`` (1, 2, ...) of a start the sidecar
    did not admit, seconds: :data:`RETRY_FIRST_S` doubled per attempt, at
    most :data:`RETRY_MAX_S`. Raises ValueError for ``attempt`` < 1. Pure."""
    if attempt < 1:
        raise ValueError("attempts count from 1")
    return float(min(RETRY_FIRST_S * 2 ** min(attempt - 1, 16), RETRY_MAX_S))


async def run(runtime: ActionRuntime, live: LiveAction, *, mark_sent: bool = True, recheck: bool = True) -> None:
    """The background dispatch task of a running action (:meth:`ActionService.start`): take its lease,
    re-check a governed action's approval, run the job until the sidecar admits it, store its chunks and
    its result. Never raises but CancelledError: a failure is recorded as the action's result, a store
    outage leaves it to the reconciler (ARCHITECTURE.md §9, §10). Every write it makes (chunks, dispatch
    state, requeues, its result with usage and receipt) carries the fencing token it took with the lease
    (:attr:`~.live.LiveAction.lease_token`), and once any of them met ``LeaseLost`` it writes nothing
    more: another host dispatches the action (ARCHITECTURE.md §10, dispatch leases). Traced as ``aip.action.dispatch``
    (docs/observing.md "Observing actions"), continuing the action's stored trace context."""
    with dispatching(live.job.trace, runtime.now_ms()) as span:
        await _dispatch(runtime, live, mark_sent=mark_sent, recheck=recheck)
        if live.final is not None:
            record_outcome(span, live.final)


async def _dispatch(runtime: ActionRuntime, live: LiveAction, *, mark_sent: bool, recheck: bool) -> None:
    job = live.job
    tenant, action_id = job.tenant, job.action_id
    structlog.contextvars.clear_contextvars()  # this task's own context: drop the request that started it
    structlog.contextvars.bind_contextvars(action_id=action_id, tenant=tenant, crew_id=job.crew_id)

    sink = ChunkSink(runtime.store, live)
    try:
        if not await runtime.store.take_lease(
            tenant, action_id
        ):  # another host holds its dispatch lease (ARCHITECTURE.md §10)
            log.info("action_leased_elsewhere")
            return
        # The token this dispatch works under: every write below carries it, its chunks' too.
        live.lease_token = runtime.store.lease_token(tenant, action_id)
        sink.hold(live.lease_token)
        if job.spec.approval and recheck:  # governed: re-check what its approval relied on, before sending
            record = await runtime.store.get_action(tenant, action_id)
            revoked = runtime.revocation(record) if record is not None else None
            if record is not None and revoked is not None:
                await runtime.writer.finish(
                    tenant,
                    action_id,
                    failed_result(action_id, revoked),
                    DispatchState.NOT_SENT.value,
                    settle_dispatch=True,
                    lease_token=live.lease_token,
                )
                return
        result = await _run_until_admitted(runtime, live, sink.add, mark_sent=mark_sent)
        if result is None:  # no longer running (a cancel won while it waited), or deferred to the reconciler
            await sink.drain()
            return
        tail = await sink.rest()  # the stream's last chunks go in the result's own write
        result = await answer_before_admission(runtime, job, result)
        # The dispatch's own final word on how far its request got (`not_sent` after a refused connection).
        live.final = await runtime.writer.finish(
            tenant,
            action_id,
            result,
            job.dispatch.state,
            operation=job.spec.name,
            durable=job.durable,
            settle_dispatch=True,
            chunks=tail,
            lease_token=live.lease_token,
        )
    except asyncio.CancelledError:
        sink.discard()  # a cancelled dispatch stores no further chunks (its canceller records the result)
        raise
    except LeaseLost:  # another host took the lease while this one was paused: nothing more is written here
        sink.discard()
        log.warning("lease_lost", stopped="dispatch")
    except StoreUnavailable:
        # The store cannot be written now (an outage): the action stays running (its lease this host's),
        # and the job goes on at the sidecar. The reconciler (every RECONCILE_S) re-attaches to it once
        # the store answers again, replaying the chunks not yet stored, and records its real outcome;
        # writing a failure here would give a tenant "failed" for a run that completes.
        sink.discard()
        log.warning("dispatch_deferred", reason="store unavailable")
    except Exception as exc:  # never lose an action: record a failure instead
        log.exception("dispatch_crashed")
        await _record_crash(runtime, live, sink, exc)
    finally:
        runtime.live.remove(tenant, action_id)
        live.notify()


def saw_lease_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` is :class:`~..store.records.LeaseLost` or was raised while handling one, or because
    of one (its ``__cause__`` / ``__context__`` chain). Pure."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LeaseLost):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


async def _record_crash(runtime: ActionRuntime, live: LiveAction, sink: ChunkSink, exc: Exception) -> None:
    """A dispatch that failed unexpectedly (``exc``): store the chunks received, then a failed result, both
    under the dispatch's token. A dispatch that has seen ``LeaseLost`` anywhere (behind ``exc``, in its
    chunk writer, in this drain, in the result write) writes nothing more: another host holds the lease
    and dispatches the action; a store outage leaves the action to the reconciler (ARCHITECTURE.md §10)."""
    job = live.job
    if saw_lease_lost(exc):
        sink.discard()
        log.warning("lease_lost", stopped="dispatch")
        return
    try:
        await sink.drain()  # keep what was received ...
    except Exception as failed:  # ... unless storing is what failed (then the result is still recorded)
        if saw_lease_lost(failed):  # the chunk writer was refused: this host no longer holds the lease
            sink.discard()
            log.warning("lease_lost", stopped="dispatch")
            return
    error = AipError("the host failed while dispatching the action")
    try:
        await runtime.writer.finish(
            job.tenant,
            job.action_id,
            failed_result(job.action_id, error),
            job.dispatch.state,
            operation=job.spec.name,
            lease_token=live.lease_token,
        )
    except LeaseLost:
        log.warning("lease_lost", stopped="dispatch")
    except StoreUnavailable:  # the reconciler settles it once the store answers (as in _dispatch)
        log.warning("dispatch_deferred", reason="store unavailable")


async def _run_until_admitted(
    runtime: ActionRuntime, live: LiveAction, on_chunks: OnChunks, *, mark_sent: bool
) -> ActionResult | None:
    """Run the job; a start the sidecar provably did not admit is placed
    on another ready sidecar of its crew at once (:func:`_elsewhere`), else
    retried (same job id and idempotency key, so never run twice) after
    :func:`retry_delay_s`, the action requeued meanwhile (tenants
    see ``queued``), until the dispatch deadline: then a failed result
    ``connector.crewai.dispatch_deadline`` with ``uncertain_outcome:
    false`` (ARCHITECTURE.md §9). A start not placed yet is placed first
    (:class:`~..sidecars.placement.Placement`); every placement is recorded
    with the action before the start is sent (docs/operating.md "Several sidecars").
    Returns the result to store, or None: the action stopped running
    meanwhile (a cancel), or its silent stream is left to the reconciler
    (:class:`~.dispatch.DispatchDeferred`)."""
    job = live.job
    placement = runtime.dispatcher.placement
    attempts, waits, deadline_ms = 0, 0, None
    refused: set[str] = set()  # sidecars that refused this start since the last wait
    lacking: set[str] = set()  # a replay: sidecars that hold no run of its task id
    if job.spec.startable and job.sidecar is None:  # not placed yet (an approved action): place it now
        # Always a name: the recorded placement is what a cancel on any host serializes with (ARCHITECTURE.md §8).
        job.sidecar, mark_sent = placement.place(job.crew_id) or placement.home(job.crew_id), True
    while True:
        if (
            mark_sent
            and await runtime.writer.mark_sent(
                job.tenant, job.action_id, durable=job.durable, sidecar=job.sidecar, lease_token=live.lease_token
            )
            is None
        ):
            return None  # no longer running (cancelled while queued): nothing is sent
        try:
            return await runtime.dispatcher.run(job, on_chunks)
        except DispatchDeferred as deferred:
            log.warning("dispatch_deferred", code=deferred.error.code)
            return None
        except StartNotAdmitted as refusal:
            attempts += 1
            where = job.sidecar or placement.home(job.crew_id)
            (lacking if refusal.elsewhere_only else refused).add(where)
            other = _elsewhere(runtime, job, refused, lacking, replay=refusal.elsewhere_only)
            log.info("dispatch_not_admitted", code=refusal.error.code, attempts=attempts, sidecar=where, to=other)
            if other is not None:  # another sidecar of the crew takes it now: no wait
                job.sidecar, job.dispatch, mark_sent = other, DispatchProgress(), True
                continue
            if refusal.elsewhere_only and not refused:  # no sidecar of the crew holds the task run: that is the answer
                return failed_result(job.action_id, refusal.error)
            job.dispatch.state = DispatchState.NOT_SENT
            if deadline_ms is None:
                deadline_ms = await _deadline_ms(runtime, job.tenant, job.action_id)
            remaining_ms = deadline_ms - runtime.now_ms()
            if remaining_ms <= 0:
                return failed_result(
                    job.action_id,
                    ConnectorDispatchDeadline(
                        operation=job.spec.name,
                        remote_status=refusal.error.remote_status,
                        uncertain_outcome=False,
                        read_only=job.spec.read_only,
                        dispatch=DispatchState.NOT_SENT.value,
                        details={
                            "deadline_seconds": runtime.dispatch_deadline_ms / 1000,
                            "attempts": attempts,
                            "last_cause": refusal.error.code,
                        },
                    ),
                )
            if (
                await runtime.writer.requeue(
                    job.tenant, job.action_id, durable=job.durable, lease_token=live.lease_token
                )
                is None
            ):
                return None
            live.notify()
            live.retry_waiting = True
            waits += 1
            try:
                await asyncio.sleep(min(retry_delay_s(waits), remaining_ms / 1000))
            finally:
                live.retry_waiting = False
            refused.clear()  # after the wait every sidecar of the crew may take it again
            job.dispatch = DispatchProgress()
            job.sidecar = placement.place(job.crew_id, exclude=lacking) or job.sidecar
            mark_sent = True


def _elsewhere(runtime: ActionRuntime, job: Job, refused: set[str], lacking: set[str], *, replay: bool) -> str | None:
    """Where a start refused before admission goes at once: another READY sidecar of the crew that has
    not refused it (:meth:`.Placement.place`), or for a ``replay`` whose task run the sidecar does not
    hold, the next sidecar of the crew in configuration order that may hold it; None: none (wait)."""
    placement = runtime.dispatcher.placement
    if replay:
        return next((n for n in placement.candidates(job.crew_id) if n not in refused | lacking), None)
    return placement.place(job.crew_id, exclude=refused | lacking, ready_only=True)


async def _deadline_ms(runtime: ActionRuntime, tenant: str, action_id: str) -> int:
    """When retries of an action's start stop, epoch ms: the dispatch
    deadline after the action could first run (its approval's decision,
    else its admission), both stored, so a restart keeps the deadline."""
    record = await runtime.record(tenant, action_id)
    since = record.created_at
    if record.approval_id:
        approval = await runtime.store.get_approval(tenant, record.approval_id)
        if approval is not None and approval.decided_at is not None:
            since = approval.decided_at
    return since + runtime.dispatch_deadline_ms


async def answer_before_admission(runtime: ActionRuntime, job: Job, result: ActionResult) -> ActionResult:
    """``result`` of a ``status`` or an ``events`` page, unless the sidecar answered it 404 for a run it does
    not know because it has not admitted it: never sent (pending approval, denied, expired, cancelled before
    dispatch) or its start still on the way (just approved). Then the host's own view of that run, in the
    shape of the sidecar's answer, instead of a failure blaming the configuration: for ``status`` the job
    view (the run's state, 0 events), for an ``events`` page an empty page at the asked cursor. A run whose
    start the sidecar answered (``acknowledged``) when the host reads it after the 404 is asked once more,
    on the sidecar the store places it on: the 404 may predate that answer (the start was admitted while the
    read was on its way), and the second answer stands, a 404 included. A streamed ``events`` keeps its 404
    (ARCHITECTURE.md §9, inspections of a run)."""
    if not _unknown_to_sidecar(result) or not host_may_answer(job):
        return result
    run_action_id = str(job.input["run_action_id"])
    target = await runtime.store.get_action(job.tenant, run_action_id)
    if target is None:
        return result  # not the caller's run: the action's write answers ActionNotFound
    if target.dispatch == DispatchState.ACKNOWLEDGED:
        job.target_sidecar = target.sidecar
        log.info("read_asked_again", run_action_id=run_action_id, reason="run admitted since the 404")
        result = await runtime.dispatcher.run(job, no_chunks)
        if _unknown_to_sidecar(result) and result.error is not None:  # a run its sidecar admitted, unknown there
            log.warning("dispatch_failed", code=result.error.code, operation=job.spec.name, dispatch=job.dispatch.state)
        return result
    if job.spec.name == "status":
        view: dict[str, object] = {
            "action_id": run_action_id,
            "crew_id": target.crew_id,
            "operation": target.operation,
            "status": target.status,
            "event_count": 0,
            "output": None,
        }
    else:
        cursor = int(job.input.get("cursor") or 0)
        view = {
            "action_id": run_action_id,
            "cursor": cursor,
            "next_cursor": cursor,
            "status": target.status,
            "events": [],
        }
    return ActionResult(action_id=job.action_id, status="completed", output=view)


def _unknown_to_sidecar(result: ActionResult) -> bool:
    """``result`` is the sidecar's 404 for a job it does not know."""
    return result.error is not None and (result.error.details or {}).get("remote_status") == 404


async def no_chunks(chunks: list[Any]) -> None:
    """The chunk sink of a read that streams none (``status``, an ``events`` page)."""


#: The longest an ``events`` read waits for its target run's start to be answered by the sidecar, seconds.
TARGET_START_WAIT_S = 5.0
#: The first pause between two reads of the target's record, seconds; doubling up to :data:`_TARGET_POLL_MAX_S`.
_TARGET_POLL_FIRST_S = 0.01
_TARGET_POLL_MAX_S = 0.25


async def await_target_start(store: Store, tenant: str, run_action_id: str) -> str | None:
    """Return once run ``run_action_id``'s start was answered by its sidecar (dispatch ``acknowledged``), the
    run is not ``running`` (pending, ended, unknown), or :data:`TARGET_START_WAIT_S` passed: the run's
    placement as last read (its sidecar's name; None: not placed, or no such run). The run may be
    dispatched by another host, so the store is read (every 10 ms, doubling to 250 ms), not a local signal;
    a run whose start was answered costs one read, the one its placement needs anyway.

    Why: an ``events`` read sent right after the run's approval would otherwise reach the sidecar before the
    run's own start and get a 404 for a run that exists (ARCHITECTURE.md §9, inspections of a run). A run
    left queued (its sidecar down) costs the read the bound, then the sidecar's answer stands as before.

    Raises:
        StoreUnavailable: the store cannot be read (the read fails as any store outage does)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + TARGET_START_WAIT_S
    pause = _TARGET_POLL_FIRST_S
    while True:
        target = await store.get_action(tenant, run_action_id)
        if target is None or target.status != ActionState.RUNNING or target.dispatch == DispatchState.ACKNOWLEDGED:
            return target.sidecar if target is not None else None
        if loop.time() + pause > give_up:
            log.info("target_start_not_answered", run_action_id=run_action_id, waited_s=TARGET_START_WAIT_S)
            return target.sidecar
        await asyncio.sleep(pause)
        pause = min(pause * 2, _TARGET_POLL_MAX_S)
