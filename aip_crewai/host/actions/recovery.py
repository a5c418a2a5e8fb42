"""Restart recovery of the action service: settling the actions and approvals
a previous host process left behind, and the periodic approval-expiry sweep.

A running action nobody in this process dispatches is reconciled with its
sidecar job (read, or followed live when streamed) and never re-dispatched.
One the sidecar never admitted (the previous process died before its start
request was admitted) is dispatched now when it may still run, else fails
with a certain outcome (``not_sent``): see :func:`_admit_or_fail`.
Functions take an :class:`~aip_crewai.host.actions.writer.ActionRuntime` (the action
service) first and change state only through its writer;
``ActionService.reconcile`` and the actions lifespan call them.

Source: docs/approvals.md "The approval flow", "Failure behaviour"; docs/ARCHITECTURE.md "Action states".
"""

from __future__ import annotations

import asyncio
import dataclasses

import anyio
import msgspec
import structlog

from ...contracts import operations as ops
from ...contracts.aip import ActionResult, StreamChunk
from ...contracts.errors import (
    AipError,
    ConnectorCancelledUnconfirmed,
    ConnectorInvalidStream,
    ConnectorResponseTooLarge,
)
from ...contracts.sidecar import JobEvent
from ..sidecars.client import DispatchProgress
from ..store.store import ActionRecord, LeaseLost, StoreUnavailable
from .chunk_sink import ChunkSink
from .dispatch import DispatchDeferred, Job, StartNotAdmitted
from .lifecycle import (
    CANCEL_OUTCOMES,
    PROVISIONAL_CODES,
    PROVISIONAL_MARKERS,
    ActionState,
    CancelCase,
    DispatchState,
    approval_admits,
    is_terminal,
    result_is_final,
)
from .live import LiveAction
from .normalize import failed_result, result_from_terminal
from .writer import ActionRuntime

log = structlog.get_logger(__name__)

#: How often pending approvals are swept for expiry, seconds.
EXPIRY_SWEEP_S = 5.0
#: How often running actions no task here follows are reconciled with the sidecar, seconds.
RECONCILE_S = 5.0
#: Bound of one correction of a provisional result (its sidecar reads), seconds: a frozen sidecar
#: must hold neither a tenant's read nor the reconciler's pass. A tenant's read waits at most this for the
#: whole correction; the reconciler waits this for the job's view, then :data:`BACKFILL_BOUND_S`.
CORRECT_BOUND_S = 3.0
#: Bound of reading an ended job's whole journal back (the stream a correction backfills), once the sidecar
#: answered for the job, seconds: a long stream (up to the response bound) takes longer than one view.
BACKFILL_BOUND_S = 30.0
#: ``reconciled`` of a correction whose journal the host's normalizer refuses (over a bound, invalid on every
#: read): the live stream's own typed error, final (ARCHITECTURE.md §9 "Final results").
JOURNAL_REFUSED = "journal_refused"


async def sweep_expired(runtime: ActionRuntime) -> None:
    """Every :data:`EXPIRY_SWEEP_S`: :func:`expire_due`."""
    while True:
        await asyncio.sleep(EXPIRY_SWEEP_S)
        try:
            await expire_due(runtime)
        except StoreUnavailable:  # logged by the store; the next sweep tries again
            pass
        except Exception:  # housekeeping must not kill the host
            log.exception("approval_sweep_failed")


async def expire_due(runtime: ActionRuntime) -> None:
    """Expire every pending approval whose TTL passed and fail each one's
    pending action (``policy.approval_expired``), whoever triggers it: the
    sweep, the approval list, or a read of one of them."""
    await runtime.writer.expire_due(runtime.now_ms())


async def reconcile_all(runtime: ActionRuntime) -> None:
    """After a restart: settle actions the previous process left running, and
    approvals it decided without applying the decision, or never wrote. Then,
    every :data:`RECONCILE_S`, settle running actions no task of this process
    dispatches or follows: those the sidecar could not be asked about yet
    (unreachable at the restart) are retried without waiting for a reader."""
    for record in [*await runtime.store.list_in_flight(), *await runtime.store.list_awaiting_approval()]:
        await _settle(runtime, record)
    await correct_provisional(runtime)
    while True:
        await asyncio.sleep(RECONCILE_S)
        try:
            in_flight = await runtime.store.list_in_flight()
        except StoreUnavailable:  # logged by the store; the next pass tries again
            continue
        except Exception:  # housekeeping must not kill the host
            log.exception("reconcile_listing_failed")
            continue
        for record in in_flight:
            if runtime.live.get(record.tenant, record.action_id) is None:
                await _settle(runtime, record, reread=True)
        await correct_provisional(runtime)


async def renew_leases(runtime: ActionRuntime) -> None:
    """Every third of the lease: extend this host's dispatch leases (ARCHITECTURE.md §10). A host that stops
    renewing (killed, frozen) loses them when they expire, and another host's reconciler takes its
    running actions over (:meth:`~.actions.ActionService.refresh`). A lease found taken by another host
    (this one was paused past it) ends this host's dispatch or follower of that action at once, without
    a write (the new holder follows the job): log ``lease_lost``."""
    interval_s = max(runtime.store.lease_ms / 3000, 0.05)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await runtime.store.renew_leases()
        except StoreUnavailable:  # logged by the store; renewed at the next tick (a third of the lease)
            pass
        except Exception:  # housekeeping must not kill the host
            log.exception("lease_renewal_failed")
        for tenant, action_id in runtime.store.lost_leases():
            live = runtime.live.get(tenant, action_id)
            if live is not None and live.task is not None and not live.task.done():
                log.warning("lease_lost", tenant=tenant, action_id=action_id, stopped="dispatch")
                live.task.cancel()


async def correct_provisional(runtime: ActionRuntime) -> None:
    """Re-read from the sidecar every stored result that is not final
    (:func:`~.lifecycle.result_is_final`) and correct it (:func:`correct`);
    errors are logged (the periodic half of ARCHITECTURE.md §9 "Final results")."""
    try:
        candidates = await runtime.store.list_failed_with(sorted(PROVISIONAL_CODES), PROVISIONAL_MARKERS)
    except StoreUnavailable:  # logged by the store; the next pass tries again
        return
    except Exception:  # housekeeping must not kill the host
        log.exception("correction_listing_failed")
        return
    for record in candidates:
        try:
            await correct(runtime, record)  # bounded inside: the view, then the journal read back
        except TimeoutError:  # the sidecar does not answer (frozen): the next pass tries again
            log.warning("correction_deferred", action_id=record.action_id)
            return
        except Exception:
            log.exception("correction_failed", action_id=record.action_id)


def is_final(record: ActionRecord, result: ActionResult | None) -> bool:
    """Whether ``record``'s stored ``result`` is final (:func:`~.lifecycle.result_is_final`). Pure."""
    if not is_terminal(record.status) or result is None:
        return is_terminal(record.status)
    error = result.error
    return result_is_final(
        record.status,
        startable=ops.get(record.operation).startable,
        error_code=error.code if error is not None else None,
        details=error.details if error is not None else None,
    )


async def correct(runtime: ActionRuntime, record: ActionRecord) -> ActionRecord | None:
    """Correct one stored result that is not final from the sidecar's job
    (ARCHITECTURE.md §9 "Final results"): the job's terminal event replaces
    it (``correct_*``), with the job's whole stream read back from the journal
    (:func:`from_journal`): the chunks the host did not store are backfilled in
    the same fenced write, so a corrected action carries every chunk, in order,
    ending with ``done``; a job the sidecar does not know (404: never admitted,
    or archived) leaves the result as it is, marked ``reconciled:
    "job_unknown"`` (final: there is nothing more to learn); a job still
    running, or a sidecar that cannot be read, changes nothing now.
    Returns the corrected record, or None when nothing changed.

    Raises:
        TimeoutError: the job's view did not answer within :data:`CORRECT_BOUND_S`."""
    result = await runtime.result(record)
    if is_final(record, result) or result is None or result.error is None:
        return None
    job = runtime.job(record, stream=False)
    try:
        with anyio.fail_after(CORRECT_BOUND_S):
            terminal = await runtime.dispatcher.terminal_event(job)
    except AipError as exc:
        if exc.details.get("remote_status") != 404:
            return None
        error = msgspec.structs.replace(
            result.error, details={**(result.error.details or {}), "reconciled": "job_unknown"}
        )
        return await runtime.writer.correct(record, msgspec.structs.replace(result, error=error), dispatch=None)
    if terminal is None:
        return None
    settled = await from_journal(runtime, job, terminal)
    if settled is None:
        return None
    return await runtime.writer.correct(record, settled[0], chunks=settled[1])


async def from_journal(
    runtime: ActionRuntime, job: Job, terminal: JobEvent
) -> tuple[ActionResult, list[StreamChunk]] | None:
    """What an ended job's journal says, for a result settled from it rather than from the host's own
    stream (a correction, :func:`correct`; a cancel that found the job ended, :mod:`.cancellation`):
    ``(result, chunks)``, the result of its terminal event (``terminal``, already read) and, for a streamed
    operation, its WHOLE stream read back from the first event (``GET /jobs/{id}/events`` as SSE, cursor
    0) through the host's own normalizer (:meth:`.Dispatcher.resume`: the same sequence, frame, event-count
    and response bounds as a live stream, the same bounded rereads of a broken read), chunk sequences
    equal to the journal's. The writer stores the chunks the action lacks with the result, in one fenced
    write (:meth:`~.writer.ActionWriter.correct`, :meth:`~.writer.ActionWriter.finish`).

    A journal the normalizer refuses (over a bound, or invalid on every read) ends as a live stream
    would: ``failed`` with its typed error (``connector.crewai.response_too_large`` or
    ``invalid_stream``), marked ``reconciled``: :data:`JOURNAL_REFUSED` and ``job_status`` (final), with
    the valid chunks before the refusal. None: the journal cannot be read whole now (unreachable,
    silent, gone, past :data:`BACKFILL_BOUND_S`); the next pass tries again. ARCHITECTURE.md §9 "Final results"."""
    if not job.spec.stream:  # a blocking operation: the host stores no stream of it
        return result_from_terminal(job.action_id, job.spec, terminal), []
    chunks: list[StreamChunk] = []

    async def collect(batch: list[StreamChunk]) -> None:
        chunks.extend(batch)

    # From the first event; the sidecar answered for the job, so its start was admitted.
    reader = dataclasses.replace(job, first_chunk_sequence=0, dispatch=DispatchProgress(DispatchState.ACKNOWLEDGED))
    try:
        with anyio.fail_after(BACKFILL_BOUND_S):
            result = await runtime.dispatcher.resume(reader, collect)
    except (ConnectorInvalidStream, ConnectorResponseTooLarge) as exc:
        exc.details.update(reconciled=JOURNAL_REFUSED, job_status=terminal.event)
        log.warning("journal_refused", action_id=job.action_id, code=exc.code, chunks=len(chunks))
        result = failed_result(job.action_id, exc)
    except (AipError, DispatchDeferred, StartNotAdmitted, TimeoutError) as exc:
        log.warning("journal_read_deferred", action_id=job.action_id, error=type(exc).__name__)
        return None
    return result, chunks


async def _settle(runtime: ActionRuntime, record: ActionRecord, *, reread: bool = False) -> None:
    """:meth:`ActionService.refresh` of one action, errors logged. ``reread``:
    read it again first (a listing may predate the end of a dispatch of this
    process) and settle it only if it is still running with no task here."""
    try:
        if reread:
            fresh = await runtime.store.get_action(record.tenant, record.action_id)
            if fresh is None or fresh.status != ActionState.RUNNING or runtime.live.get(fresh.tenant, fresh.action_id):
                return
            record = fresh
        await runtime.refresh(record)
    except StoreUnavailable:  # the store logged why (no traceback: a fault, not a bug); the next pass retries
        log.warning("reconcile_deferred", action_id=record.action_id, code="store.unavailable")
    except Exception:
        log.exception("reconcile_failed", action_id=record.action_id)


async def reconcile(runtime: ActionRuntime, record: ActionRecord, *, lease_token: int | None = None) -> None:
    """Settle a running action left by a previous host process. ``lease_token``: the fencing token the
    caller took with the action's lease (``ActionService.refresh``): every result this writes carries it,
    and one refused for it (``LeaseLost``: another host took the lease) ends the reconciliation without a
    write, logged ``lease_lost`` (ARCHITECTURE.md §10, dispatch leases)."""
    try:
        await _reconcile(runtime, record, lease_token)
    except LeaseLost:
        log.warning("lease_lost", action_id=record.action_id, stopped="reconcile")


async def _reconcile(runtime: ActionRuntime, record: ActionRecord, lease_token: int | None) -> None:
    job = runtime.job(record, stream=False)
    spec = job.spec
    if not spec.startable:
        # Inspection reads are not journaled by the sidecar: their outcome is unknown, re-reading is safe.
        row = CANCEL_OUTCOMES[CancelCase.DETACH_READ]  # what a cancel of the read would store
        result = ActionResult(action_id=record.action_id, status="cancelled", output=dict(row.output or {}))
        await runtime.writer.finish(record.tenant, record.action_id, result, None, lease_token=lease_token)
        return
    if spec.stream:
        _resume(runtime, record)  # follow the sidecar job live: its chunks since the restart, then its result
        return
    try:
        terminal = await runtime.dispatcher.terminal_event(job)
    except AipError as exc:
        if exc.details.get("remote_status") == 404:  # the sidecar never admitted it
            await _admit_or_fail(runtime, record, lease_token)
        elif exc.details.get("dispatch") == DispatchState.NOT_SENT:  # unreachable: its dispatch retries, deadline
            await _start_if_may_run(runtime, record)
        return
    if terminal is None:
        return  # still running at the sidecar; a later read settles it
    await runtime.writer.finish(
        record.tenant,
        record.action_id,
        result_from_terminal(record.action_id, spec, terminal),
        DispatchState.ACKNOWLEDGED.value,
        lease_token=lease_token,
    )


async def _may_still_run(runtime: ActionRuntime, record: ActionRecord) -> bool:
    """Whether a running action the sidecar never admitted may be dispatched
    now: its operation needs no approval, or its approval is approved, bound
    to it and decided before it expired (:func:`.lifecycle.approval_admits`;
    the TTL bounds the decision, not the run: ARCHITECTURE.md §7). A start the
    sidecar did answer (``acknowledged``) was admitted: its job being gone
    is no reason to run it again."""
    if record.dispatch == DispatchState.ACKNOWLEDGED:
        return False
    if not ops.get(record.operation).approval:
        return True
    approval = await runtime.store.get_approval(record.tenant, record.approval_id) if record.approval_id else None
    return approval is not None and approval_admits(approval, record)


async def _admit_or_fail(runtime: ActionRuntime, record: ActionRecord, lease_token: int | None) -> None:
    """A running action whose job the sidecar does not know: dispatch it now
    if it may still run (:func:`_may_still_run`), else fail it as never
    dispatched. Dispatching is safe: the sidecar admits a job id once
    (``Idempotency-Key`` and request hash), so a start request of the dead
    process that is admitted after all is joined, never run twice. ``lease_token``: the caller's (the
    failure is written under it; a dispatch started here takes the lease itself)."""
    if await _may_still_run(runtime, record):
        log.info("action_dispatched_after_restart")
        runtime.start(record, stream=True)
    else:
        await _fail_never_admitted(runtime, record, lease_token)


async def _start_if_may_run(runtime: ActionRuntime, record: ActionRecord) -> None:
    """A running action whose sidecar cannot be reached now: when it may
    still run (:func:`_may_still_run`: never acknowledged), dispatch it, so
    its start is retried with backoff up to its dispatch deadline
    (ARCHITECTURE.md §9; the sidecar joins a start it admitted already);
    else leave it for a later reconciliation."""
    if await _may_still_run(runtime, record):
        log.info("action_dispatched_after_restart", sidecar="unreachable")
        runtime.start(record, stream=True)


async def _fail_never_admitted(runtime: ActionRuntime, record: ActionRecord, lease_token: int | None) -> None:
    await runtime.writer.finish(
        record.tenant,
        record.action_id,
        failed_result(
            record.action_id,
            ConnectorCancelledUnconfirmed(
                "the host restarted before the sidecar admitted the action",
                operation=record.operation,
                remote_status=404,
                uncertain_outcome=False,
                dispatch="not_sent",
            ),
        ),
        DispatchState.NOT_SENT.value,
        lease_token=lease_token,
    )


def _resume(runtime: ActionRuntime, record: ActionRecord) -> None:
    """Re-attach to the sidecar job of a running streamed action no task
    here dispatches, i.e. one a previous host process left running; after a
    follower that ended without a result, only once its pause has passed
    (:meth:`LiveRegistry.follow_failed`). Read-only
    (:meth:`Dispatcher.resume`): never re-dispatched."""
    now = asyncio.get_running_loop().time()
    if runtime.live.get(record.tenant, record.action_id) is not None:
        return
    if not runtime.live.may_follow(record.tenant, record.action_id, now):
        return  # its last follower ended without a result moments ago (LiveRegistry.follow_failed)
    live = LiveAction(job=runtime.job(record, stream=True))
    runtime.live.add(live)
    live.task = asyncio.get_running_loop().create_task(
        _follow_sidecar(runtime, live), name=f"resume:{record.action_id}"
    )


async def _follow_sidecar(runtime: ActionRuntime, live: LiveAction) -> None:
    job = live.job
    tenant, action_id = job.tenant, job.action_id
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(action_id=action_id, tenant=tenant, crew_id=job.crew_id)
    sink = ChunkSink(runtime.store, live)
    never_admitted: ActionRecord | None = None
    unreachable: ActionRecord | None = None
    try:
        if not await runtime.store.take_lease(tenant, action_id):
            log.info("action_leased_elsewhere")  # another host holds its dispatch lease and follows it
            return
        # The token this follower works under: every write below carries it, its chunks' too.
        live.lease_token = runtime.store.lease_token(tenant, action_id)
        sink.hold(live.lease_token)
        log.info("action_resumed", from_chunk=job.first_chunk_sequence)
        result = await runtime.dispatcher.resume(job, sink.add)
        live.final = await runtime.writer.finish(
            tenant,
            action_id,
            result,
            DispatchState.ACKNOWLEDGED.value,
            operation=job.spec.name,
            durable=job.durable,
            chunks=await sink.rest(),  # the stream's last chunks go in the result's own write
            lease_token=live.lease_token,
        )
    except asyncio.CancelledError:
        sink.discard()
        raise
    except LeaseLost:  # another host took the lease while this one was paused: it follows the job now
        sink.discard()
        log.warning("lease_lost", stopped="follower")
    except (AipError, StartNotAdmitted, DispatchDeferred) as exc:
        try:
            await sink.drain()
        except LeaseLost:  # its chunk writer was refused: it writes nothing more (the new holder follows)
            sink.discard()
            log.warning("lease_lost", stopped="follower")
            return
        except Exception:  # storing the chunks is what failed: the next reconciliation replays them
            pass
        error = exc if isinstance(exc, AipError) else exc.error
        if error.details.get("remote_status") == 404:  # the sidecar never admitted it
            never_admitted = await runtime.store.get_action(tenant, action_id)
        elif error.details.get("dispatch") == DispatchState.NOT_SENT:  # unreachable: dispatch with retries
            unreachable = await runtime.store.get_action(tenant, action_id)
        else:  # the sidecar cannot be read now: the action stays running, the next read retries
            log.warning("action_resume_deferred", code=error.code)
    except Exception:  # nothing more is written here (the next reconciliation replays its chunks)
        sink.discard()
        log.exception("action_resume_failed")
    finally:
        runtime.live.remove(tenant, action_id)
        if live.final is None:
            runtime.live.follow_failed(tenant, action_id, asyncio.get_running_loop().time())
        else:
            runtime.live.follow_ended(tenant, action_id)
        live.notify()
    if never_admitted is not None and never_admitted.status == ActionState.RUNNING:
        try:  # after this follower left the live registry; a failure under the follower's token
            await _admit_or_fail(runtime, never_admitted, live.lease_token)
        except LeaseLost:
            log.warning("lease_lost", stopped="follower")
    elif unreachable is not None and unreachable.status == ActionState.RUNNING:
        await _start_if_may_run(runtime, unreachable)
