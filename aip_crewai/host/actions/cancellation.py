"""Runtime cancellation of an action by its own tenant.

Which outcome applies is data: :func:`~.lifecycle.cancel_case` picks the row
of :data:`~.lifecycle.CANCEL_OUTCOMES` for the action's state and operation;
this module carries the row out over the writer, the dispatcher and the live
registry of an :class:`~.writer.ActionRuntime`.

Source: docs/reference/http-api.md "Capabilities"; docs/ARCHITECTURE.md "Action states".
"""

from __future__ import annotations

import asyncio
from typing import Any

from ...contracts import operations as ops
from ...contracts.aip import ActionResult, StreamChunk
from ...contracts.errors import AipError, ConnectorCancelledUnconfirmed, NotCancellable
from ..auth.principals import Principal
from .dispatch import Job
from .lifecycle import CANCEL_OUTCOMES, ActionState, CancelCase, DispatchState, cancel_case, is_terminal
from .live import LiveAction
from .normalize import failed_result
from .recovery import from_journal
from .writer import ActionRuntime

#: Bound of a cancel's wait for the sidecar (a start in flight to be admitted, a followed job to end), seconds.
STOP_BOUND_S = 10.0
#: Pause between the reads of that wait, seconds.
RETRY_S = 0.02


def _outcome(case: CancelCase, action_id: str, **extra: Any) -> ActionResult:
    row = CANCEL_OUTCOMES[case]
    return ActionResult(
        action_id=action_id,
        status=row.status or "cancelled",  # type: ignore[arg-type]
        output={**(row.output or {}), **extra},
    )


async def cancel(runtime: ActionRuntime, caller: Principal, action_id: str) -> ActionResult:
    """Cancel the caller's tenant's action (docs/reference/http-api.md "Capabilities" table).

    Raises: ActionNotFound (not the tenant's), NotCancellable (memory_reset, cancel: 409).
    """
    record = await runtime.get(caller, action_id)
    operation, read_only = record.operation, ops.get(record.operation).read_only
    case = cancel_case(record.status, operation, read_only=read_only)
    if case is CancelCase.ENDED:
        return (await runtime.result(record)) or ActionResult(action_id=action_id, status=record.status)  # type: ignore[arg-type]
    if case is CancelCase.NOT_CANCELLABLE:
        raise NotCancellable(details={"operation": operation})
    tenant = record.tenant
    if case is CancelCase.WITHDRAW:
        result = _outcome(case, action_id)
        # Only while still pending, its approval withdrawn in the same commit (no decision can land after
        # it): an approval that started the action meanwhile wins the row, and the action is then cancelled
        # as the running action it now is (never "nothing happened" for a job that runs).
        if await runtime.writer.withdraw(tenant, action_id, result):
            return (await runtime.result(await runtime.record(tenant, action_id))) or result
        record = await runtime.record(tenant, action_id)
        if record.status != ActionState.RUNNING:
            return (await runtime.result(record)) or result
        case = cancel_case(record.status, operation, read_only=read_only)
    live = runtime.live.get(tenant, action_id)
    if case in (CancelCase.DETACH_READ, CancelCase.DETACH_STREAM):
        if live is not None and live.task is not None:
            live.task.cancel()
        await runtime.writer.finish(tenant, action_id, _outcome(case, action_id), None)
        return (await runtime.result(await runtime.record(tenant, action_id))) or _outcome(case, action_id)
    # Serialized through the store with every dispatch's `mark_sent`, on whichever host: cancelled here
    # while no start can be on its way (the dispatch then sends nothing), else the start was claimed first
    # and the sidecar's cancel follows it (ARCHITECTURE.md §8).
    if await _cancel_unstarted(runtime, tenant, action_id, live):
        return (await runtime.result(await runtime.record(tenant, action_id))) or _outcome(
            CancelCase.DEQUEUE, action_id
        )
    record = await runtime.record(tenant, action_id)
    if is_terminal(record.status):
        return (await runtime.result(record)) or ActionResult(action_id=action_id, status=record.status)  # type: ignore[arg-type]
    live = runtime.live.get(tenant, action_id)
    return await _stop_remote(
        runtime, record.tenant, action_id, live, live.job if live is not None else runtime.job(record, stream=True)
    )


async def _cancel_unstarted(runtime: ActionRuntime, tenant: str, action_id: str, live: LiveAction | None) -> bool:
    """Store the DEQUEUE outcome when no start of the running action can be on its way to a sidecar (not
    placed yet, or waiting to retry a start the sidecar did not admit): one conditional write that the
    dispatch's ``mark_sent`` (on any host) also races for, so exactly one of them wins. A dispatch task of
    this host is stopped. Returns whether the cancel won."""
    done = await runtime.writer.finish(
        tenant,
        action_id,
        _outcome(CancelCase.DEQUEUE, action_id),
        DispatchState.NOT_SENT.value,
        only_from=ActionState.RUNNING,
        settle_dispatch=True,
        unstarted=True,
    )
    if done is not None and live is not None and live.task is not None:
        live.task.cancel()
    return done is not None


async def _stop_remote(
    runtime: ActionRuntime, tenant: str, action_id: str, live: LiveAction | None, job: Job
) -> ActionResult:
    """The ``stop_remote`` row: the sidecar's cancel; confirmed → cancelled, else cancelled_unconfirmed."""
    if live is not None and live.task is not None:
        await _until_answered(live)  # a start still in flight may be admitted after a cancel would arrive
    if live is not None and live.task is not None and live.retry_waiting:
        # Queued for a retry of a start the sidecar did not admit: stopped before anything more is sent.
        live.task.cancel()
        await runtime.writer.finish(
            tenant,
            action_id,
            _outcome(CancelCase.DEQUEUE, action_id),
            DispatchState.NOT_SENT.value,
            settle_dispatch=True,
        )
        return (await runtime.result(await runtime.record(tenant, action_id))) or _outcome(
            CancelCase.DEQUEUE, action_id
        )
    confirmed, view = await _cancel_admitted(runtime, job)
    if confirmed is None:  # the start was refused meanwhile and the action waits for its retry: cancelled here
        return (await runtime.result(await runtime.record(tenant, action_id))) or _outcome(
            CancelCase.DEQUEUE, action_id
        )
    if confirmed and live is not None and live.task is not None:
        # The sidecar records `cancelled`; the stream ends with it. Give it a moment, then detach.
        done, _ = await asyncio.wait({live.task}, timeout=STOP_BOUND_S)
        if not done:
            live.task.cancel()
    elif confirmed:  # another host's dispatch follows the stream: it stores the chunks and the result
        await _until_recorded(runtime, tenant, action_id)
    record = await runtime.record(tenant, action_id)
    if is_terminal(record.status):
        return (await runtime.result(record)) or _outcome(CancelCase.STOP_REMOTE, action_id)
    ended = await ended_before_cancel(runtime, job, view) if confirmed else None
    chunks: list[StreamChunk] = []
    if ended is not None:  # the job finished before the cancel reached it: its real outcome, not `cancelled`
        result, chunks = ended  # with its whole stream from the journal: the chunks no dispatch stored
    elif confirmed:
        result = _outcome(
            CancelCase.STOP_REMOTE,
            action_id,
            provider_stop_observed=bool((view or {}).get("provider_stop_observed", False)),
        )
        chunks = await _stream_from_journal(runtime, job)
    else:
        if live is not None and live.task is not None:
            live.task.cancel()
        result = failed_result(
            action_id,
            ConnectorCancelledUnconfirmed(operation=job.spec.name, uncertain_outcome=True, dispatch=record.dispatch),
        )
    await runtime.writer.finish(tenant, action_id, result, None, chunks=chunks)
    return (await runtime.result(await runtime.record(tenant, action_id))) or result


async def _cancel_admitted(runtime: ActionRuntime, job: Job) -> tuple[bool | None, dict[str, Any] | None]:
    """The sidecar's cancel of a job whose start was claimed (sent, or about to be, on any host). A 404
    while the start may still be in flight (the action runs, dispatch not ``acknowledged`` as read BEFORE that
    cancel was sent) is retried until the job exists or the action ended, at most :data:`STOP_BOUND_S`: a
    cancel that overtook the start never leaves the job running unseen, even when the start is answered
    between the 404 and the read after it. ``(None, None)``: the start was refused meanwhile and the
    action waits for its retry, and this cancel stored the DEQUEUE outcome (:func:`_cancel_unstarted`).
    Else what :meth:`.Dispatcher.cancel_remote` returns."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STOP_BOUND_S
    before = await runtime.record(job.tenant, job.action_id)  # the action as it was when the cancel left
    while True:
        confirmed, view = await runtime.dispatcher.cancel_remote(job)
        if confirmed or (view or {}).get("remote_status") != 404 or loop.time() >= deadline:
            return confirmed, view
        if before.status != ActionState.RUNNING or before.dispatch == DispatchState.ACKNOWLEDGED:
            return confirmed, view  # the sidecar had answered the start before this cancel: its 404 stands
        record = before = await runtime.record(job.tenant, job.action_id)
        if record.status != ActionState.RUNNING:
            return confirmed, view  # ended meanwhile
        if record.sidecar and record.sidecar != job.sidecar:  # placed elsewhere meanwhile: cancel it there
            job.sidecar = record.sidecar
        if record.dispatch == DispatchState.ACKNOWLEDGED:
            continue  # the start was answered after this cancel left (its 404 came first): cancel again now
        if record.dispatch == DispatchState.NOT_SENT and await _cancel_unstarted(
            runtime, job.tenant, job.action_id, runtime.live.get(job.tenant, job.action_id)
        ):
            return None, None
        await asyncio.sleep(RETRY_S)


async def _until_recorded(runtime: ActionRuntime, tenant: str, action_id: str) -> None:
    """After a confirmed cancel of a job another host's dispatch follows: wait (at most
    :data:`STOP_BOUND_S`) until that host stores the job's end with its chunks, while its lease is live;
    the caller stores the outcome itself otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STOP_BOUND_S
    while loop.time() < deadline:
        record = await runtime.record(tenant, action_id)
        if is_terminal(record.status) or not runtime.store.lease_is_foreign(record):
            return
        await asyncio.sleep(RETRY_S)


async def ended_before_cancel(
    runtime: ActionRuntime, job: Job, view: dict[str, Any] | None
) -> tuple[ActionResult, list[StreamChunk]] | None:
    """The sidecar's own terminal result when the cancel found the job already
    completed or failed, with the job's whole stream read back from its journal
    (:func:`.recovery.from_journal`: the result is settled from the journal, so it
    carries every chunk); None otherwise, or when it cannot be read. A job that
    ended but whose stream cannot be read back now is stored provisional
    (``cancelled_unconfirmed``, ``uncertain_outcome: true``): the reconciler
    corrects it with its whole stream, never a ``completed`` missing chunks."""
    if (view or {}).get("status") not in ("completed", "failed"):
        return None
    try:
        terminal = await runtime.dispatcher.terminal_event(job)
    except AipError:
        return None
    if terminal is None:
        return None
    settled = await from_journal(runtime, job, terminal)
    if settled is None:
        unread = ConnectorCancelledUnconfirmed(
            operation=job.spec.name,
            uncertain_outcome=True,
            dispatch=DispatchState.ACKNOWLEDGED.value,
            details={"job_status": terminal.event},
        )
        return failed_result(job.action_id, unread), []
    return settled


async def _stream_from_journal(runtime: ActionRuntime, job: Job) -> list[StreamChunk]:
    """The cancelled job's whole stream read back from its journal (:func:`.recovery.from_journal`), for the
    chunks no dispatch stored: a lease holder frozen while this host cancels (its lease expired, so this host
    stores the end) or a live dispatch that did not end within :data:`STOP_BOUND_S` stopped short of the
    ``done`` chunk, and a ``cancelled`` result is final: nothing would fill the gap later. The writer stores
    only the chunks the action lacks. ``[]`` when the journal cannot be read now (the outcome is stored anyway).
    ARCHITECTURE.md §8 (a confirmed cancel records the end with every chunk)."""
    try:
        terminal = await runtime.dispatcher.terminal_event(job)
    except AipError:
        return []
    settled = None if terminal is None else await from_journal(runtime, job, terminal)
    return settled[1] if settled is not None else []


async def _until_answered(live: LiveAction, bound_s: float = 10.0) -> None:
    """Wait (bounded) until the live dispatch's start request was answered
    (``acknowledged``) or the dispatch ended: the sidecar admits a job before
    it answers, so until then (the request in flight, or not even sent yet
    because the dispatch task has not run) a cancel may get 404 for a job that
    is admitted a moment later and then runs unseen. A start the sidecar did
    not admit, waiting for its retry (``retry_waiting``), is answered too."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while (
        live.job.dispatch.state != DispatchState.ACKNOWLEDGED
        and live.task is not None
        and not live.task.done()
        and not live.retry_waiting
        and loop.time() < deadline
    ):
        await asyncio.sleep(0.005)
