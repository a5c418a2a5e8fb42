"""The action service: capability resolution, the idempotency and approval
fences, dispatch in the background, cancellation and restart reconciliation.

HTTP handlers (``routes_actions.py``, ``approvals.py``) stay thin over this.

Source: DESIGN.md §7 (fences), §8 (cancellation outcomes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
import structlog

from ..contracts import operations as ops
from ..contracts.aip import Action, ActionResult, ApprovalRef, StreamChunk
from ..contracts.errors import (
    ActionNotFound,
    AipError,
    ApprovalDenied,
    ApprovalExpired,
    CapabilityNotFound,
    ConnectorCancelledUnconfirmed,
    IdempotencyConflict,
    IdempotencyKeyRequired,
    InvalidInput,
    NotCancellable,
)
from ..contracts.hashing import canonical_json, input_hash, sha256_hex
from ..contracts.inputs import convert_input, has_control_characters
from ..contracts.operations import OperationSpec
from ..contracts.sidecar import MAX_IDEMPOTENCY_KEY_BYTES
from .dispatch import Dispatcher, Job
from .live import LiveAction, LiveRegistry
from .normalize import failed_result
from .sidecar_client import SidecarClient
from .auth import Principal
from .store import (
    TRANSITIONS,
    ActionRecord,
    ActionState,
    ApprovalRecord,
    MissingTarget,
    Store,
    StoreError,
    ms_to_rfc3339,
)

log = structlog.get_logger(__name__)

IDEMPOTENCY_TTL_MS = 86_400_000
APPROVAL_TTL_MS = 900_000
TERMINAL = ("completed", "failed", "cancelled")
_encode = msgspec.json.Encoder()
_result_decoder = msgspec.json.Decoder(ActionResult)


def policy_hash(tenant: str, action_id: str, capability_id: str, hashed_input: str) -> str:
    """The hash an approval binds: tenant, action id, capability and input hash (DESIGN.md §7)."""
    return sha256_hex(canonical_json(
        {"tenant": tenant, "action_id": action_id, "capability_id": capability_id, "input_hash": hashed_input}
    ))


def approval_admits(approval: ApprovalRecord, record: ActionRecord) -> bool:
    """Whether ``approval`` lets ``record`` run: approved, bound to this exact
    action (tenant, action id, capability, input hash: the policy hash), and
    decided before it expired (DESIGN.md §7). Pure."""
    return (approval.status == "approved"
            and approval.policy_hash == policy_hash(record.tenant, record.action_id, record.capability_id,
                                                    record.input_hash)
            and not (approval.decided_at is not None and approval.decided_at >= approval.expires_at))


def fence_hash(capability_id: str, value: Any) -> str:
    """What the idempotency fence revalidates: the capability and the exact input."""
    return input_hash({"capability_id": capability_id, "input": value})


def durable_action(spec: OperationSpec, key: str | None) -> bool:
    """Whether the store fsyncs an action's own writes: always, except for a
    read-only operation without an idempotency key (a ``status`` read), whose
    record a power loss may drop at no cost: no side effect, no fence rests on
    it, and the read is safe to repeat. Crashes of the host process lose
    nothing either way (see :mod:`aip_crewai.host.store`)."""
    return not (spec.read_only and key is None)


class ActionService:
    """Admits, dispatches and reports actions for one host process.

    Args:
        store: the host store.
        dispatcher: runs jobs on the sidecar.
        allowed: tenant → {crew id → allowed operation names} (default deny:
            a crew absent for a tenant does not exist for it).
        metrics: the host :class:`~aip_crewai.host.metrics.Metrics` (optional).
    """

    def __init__(
        self,
        store: Store,
        dispatcher: Dispatcher,
        allowed: Mapping[str, Mapping[str, frozenset[str]]],
        *,
        metrics: Any = None,
        now_ms: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.allowed = allowed
        self.live = LiveRegistry()
        self.metrics = metrics
        self.now_ms = now_ms or store.now_ms
        #: Actions created before this are a previous process's (no creator here may still be writing them).
        self.started_ms = self.now_ms()

    def _fence(self, fence: str, decision: str) -> None:
        if self.metrics is not None:
            self.metrics.fence_decisions.inc(fence=fence, decision=decision)

    # --- admission -------------------------------------------------------------

    def resolve(self, tenant: str, capability_id: str) -> tuple[str, OperationSpec]:
        """Resolve a capability for a tenant. Raises CapabilityNotFound (also
        for crews the tenant may not see: DESIGN.md §7)."""
        found = ops.resolve_capability(capability_id, self.allowed.get(tenant, {}))
        if found is None:
            raise CapabilityNotFound(details={"capability_id": capability_id})
        return found[0], ops.get(found[1])

    async def submit(self, caller: Principal, action: Action, envelope_key: str | None, *, stream: bool) -> ActionRecord:
        """Admit an action through both fences; start its dispatch when it may run.

        Returns the action record (new, or the existing one for a repeat).

        Raises: CapabilityNotFound, InvalidInput, IdempotencyKeyRequired,
        IdempotencyConflict, ActionNotFound (inspection of an unknown run).
        """
        tenant = caller.tenant
        crew_id, spec = self.resolve(tenant, action.capability_id)
        convert_input(spec.input_type, action.input)
        key = _idempotency_key(action.idempotency_key, envelope_key)
        if key is None and spec.key is ops.KeyRequirement.REQUIRED:
            self._fence("idempotency", "key_missing")
            raise IdempotencyKeyRequired(details={"capability_id": action.capability_id})
        run_action_id = str(action.input["run_action_id"]) if "run_action_id" in action.input else None
        if run_action_id is not None and key is not None:
            # Checked before the reservation: a request that fails here must leave no idempotency record.
            await self._check_target(tenant, crew_id, run_action_id)
        hashed = fence_hash(action.capability_id, action.input)
        if key is not None:
            record = await self.store.reserve_idempotency(
                tenant, key, action.capability_id, action.id, hashed, self.now_ms() + IDEMPOTENCY_TTL_MS
            )
            if not record.created and record.action_id != action.id:
                if record.input_hash != hashed:
                    self._fence("idempotency", "conflict")
                    raise IdempotencyConflict(details={"idempotency_key": key})
                self._fence("idempotency", "replayed")
                return await self._reserved_action(tenant, record.action_id)
        status = "pending_approval" if spec.approval else "running"
        # The approval id is fixed before the action row exists, so a concurrent
        # duplicate never sees a pending action without its approval reference.
        approval_id = "apr_" + secrets.token_urlsafe(16) if spec.approval else None
        try:
            # A running action is dispatched right after this write: it is created `sent` (one write, not two).
            # Without a key, the target check of status/events/cancel rides in the same store call.
            created, record_ = await self.store.create_action(
                tenant, action.id, action.capability_id, crew_id, spec.name, canonical_json(action.input).decode(),
                hashed, caller.id, key, status, approval_id=approval_id, timeout_ms=action.timeout_ms,
                dispatch="sent" if status == "running" else "not_sent",
                target=(run_action_id, ops.STARTABLE_OPERATIONS) if run_action_id is not None and key is None else None,
                durable=durable_action(spec, key),
            )
        except MissingTarget:
            raise ActionNotFound(details={"run_action_id": run_action_id}) from None
        if not created:
            if record_.input_hash != hashed or record_.idempotency_key != key:
                self._fence("idempotency", "conflict")
                raise IdempotencyConflict("the action id was already used with a different input or key")
            self._fence("idempotency", "replayed")
            return await self.refresh(record_)
        self._fence("idempotency", "admitted")
        if approval_id is not None:
            self._fence("approval", "requested")
            await self.store.create_approval(
                tenant, approval_id, action.id, action.capability_id,
                policy_hash(tenant, action.id, action.capability_id, hashed), caller.id,
                record_.input_json, record_.created_at + APPROVAL_TTL_MS,
            )
            return record_
        self.start(record_, stream=stream)
        return record_

    async def _reserved_action(self, tenant: str, action_id: str) -> ActionRecord:
        """The action an idempotency record points at. A concurrent first
        request may hold the reservation but not yet have written the action
        row: wait briefly (bounded) instead of answering 404."""
        for _ in range(100):
            record = await self.store.get_action(tenant, action_id)
            if record is not None:
                return await self.refresh(record)
            await asyncio.sleep(0.01)
        raise ActionNotFound(details={"action_id": action_id})

    async def _check_target(self, tenant: str, crew_id: str, run_action_id: str) -> None:
        """status/events/cancel may only name a run of the same tenant and crew."""
        target = await self.store.get_action(tenant, run_action_id)
        if target is None or target.crew_id != crew_id or not ops.get(target.operation).startable:
            raise ActionNotFound(details={"run_action_id": run_action_id})

    async def _get(self, tenant: str, action_id: str) -> ActionRecord:
        record = await self.store.get_action(tenant, action_id)
        if record is None:
            raise ActionNotFound()
        return record

    # --- dispatch --------------------------------------------------------------

    def _job(self, record: ActionRecord, *, stream: bool) -> Job:
        return Job(
            tenant=record.tenant, action_id=record.action_id, crew_id=record.crew_id,
            spec=ops.get(record.operation), input=msgspec.json.decode(record.input_json),
            idempotency_key=record.idempotency_key or record.action_id, timeout_ms=record.timeout_ms,
            stream=stream or ops.get(record.operation).name != "events", first_chunk_sequence=record.chunk_count,
            durable=durable_action(ops.get(record.operation), record.idempotency_key),
        )

    def start(self, record: ActionRecord, *, stream: bool = False) -> LiveAction:
        """Start the background dispatch of a running action (once per process)."""
        live = self.live.get(record.tenant, record.action_id)
        if live is not None:
            return live
        live = LiveAction(job=self._job(record, stream=stream))
        self.live.add(live)
        live.task = asyncio.get_running_loop().create_task(self._dispatch(live, mark_sent=record.dispatch == "not_sent"),
                                                           name=f"dispatch:{record.action_id}")
        return live

    async def _dispatch(self, live: LiveAction, *, mark_sent: bool = True) -> None:
        job = live.job
        tenant, action_id = job.tenant, job.action_id
        structlog.contextvars.clear_contextvars()  # this task's own context: drop the request that started it
        structlog.contextvars.bind_contextvars(action_id=action_id, tenant=tenant, crew_id=job.crew_id)

        sink = _ChunkSink(self.store, live)
        try:
            if mark_sent:
                await self.store.update_action(tenant, action_id, from_statuses=["running"], status="running",
                                               dispatch="sent", durable=job.durable)
            result = await self.dispatcher.run(job, sink.add)
            await sink.drain()
            live.final = await self._finish(tenant, action_id, result, job.dispatch.state, operation=job.spec.name,
                                            durable=job.durable)
        except asyncio.CancelledError:
            sink.discard()  # a cancelled dispatch stores no further chunks (its canceller records the result)
            raise
        except Exception:  # never lose an action: record a failure instead
            log.exception("dispatch_crashed")
            with contextlib.suppress(Exception):  # keep what was received, unless storing is what failed
                await sink.drain()
            error = AipError("the host failed while dispatching the action")
            await self._finish(tenant, action_id, failed_result(action_id, error), job.dispatch.state,
                               operation=job.spec.name)
        finally:
            self.live.remove(tenant, action_id)
            live.notify()

    async def _finish(self, tenant: str, action_id: str, result: ActionResult, dispatch: str | None, *,
                      operation: str | None = None, durable: bool = True) -> ActionRecord | None:
        """Store the terminal result (only from a live state). ``operation``
        (for metrics) saves a read when the caller knows it; ``durable``: see
        :func:`durable_action`. Returns the stored record, or None when the
        action had already ended (another writer's result stands)."""
        sources = [s.value for s in (ActionState.RUNNING, ActionState.PENDING_APPROVAL)
                   if ActionState(result.status) in TRANSITIONS[s]]
        changed = await self.store.update_action(
            tenant, action_id, from_statuses=sources, status=result.status,
            dispatch=dispatch, result_json=_encode.encode(result).decode(), durable=durable,
        )
        log.info("action_finished", status=result.status, changed=changed is not None)
        if changed and self.metrics is not None:
            if operation is None:
                record = await self.store.get_action(tenant, action_id)
                operation = record.operation if record else "unknown"
            self.metrics.actions.inc(operation=operation, status=result.status)
            if result.error is not None and result.error.code.startswith("connector."):
                self.metrics.stream_errors.inc(code=result.error.code)
        return changed

    # --- reading ---------------------------------------------------------------

    async def refresh(self, record: ActionRecord) -> ActionRecord:
        """Bring a record up to date: expire a stale approval; reconcile a
        running action nobody in this process dispatches (a host restart) with
        the sidecar's job, never re-dispatching it."""
        if record.status == "pending_approval" and record.approval_id:
            approval = await self.store.get_approval(record.tenant, record.approval_id)
            if approval is None and record.created_at < self.started_ms:
                # A previous process died between writing the action and its approval.
                approval = await self._restore_approval(record)
            if approval is not None and approval.effective_status(self.now_ms()) == "expired":
                await self.store.expire_approvals(self.now_ms())
                await self._finish(record.tenant, record.action_id,
                                   failed_result(record.action_id, ApprovalExpired(), dispatch="not_sent"), "not_sent")
                return await self._get(record.tenant, record.action_id)
            if approval is not None and approval.status in ("approved", "denied"):
                await self.on_decision(approval)  # decided by a process that died before applying the decision
                return await self._get(record.tenant, record.action_id)
        if record.status == "running" and self.live.get(record.tenant, record.action_id) is None:
            await self.reconcile(record)
            return await self._get(record.tenant, record.action_id)
        return record

    async def _restore_approval(self, record: ActionRecord) -> ApprovalRecord | None:
        """Write the approval a pending action points at, exactly as :meth:`submit`
        would have (same id, policy hash, requester, snapshot and expiry). A
        concurrent first request may be writing it right now: then its row wins."""
        try:
            return await self.store.create_approval(
                record.tenant, record.approval_id or "", record.action_id, record.capability_id,
                policy_hash(record.tenant, record.action_id, record.capability_id, record.input_hash),
                record.principal_id, record.input_json, record.created_at + APPROVAL_TTL_MS,
            )
        except StoreError:
            return await self.store.get_approval(record.tenant, record.approval_id or "")

    async def reconcile(self, record: ActionRecord) -> None:
        """Settle a running action left by a previous host process."""
        job = self._job(record, stream=False)
        spec = job.spec
        if not spec.startable:
            # Inspection reads are not journaled by the sidecar: their outcome is unknown, re-reading is safe.
            result = ActionResult(action_id=record.action_id, status="cancelled", dispatch=record.dispatch,  # type: ignore[arg-type]
                                  output={"remote_stop_confirmed": False, "provider_effect": "read_only",
                                          "completion_unobserved": True})
            await self._finish(record.tenant, record.action_id, result, None)
            return
        if spec.stream:
            self._resume(record)  # follow the sidecar job live: its chunks since the restart, then its result
            return
        try:
            terminal = await self.dispatcher.terminal_event(job)
        except AipError as exc:
            if exc.details.get("remote_status") == 404:  # the sidecar never admitted it
                await self._fail_never_admitted(record)
            return
        if terminal is None:
            return  # still running at the sidecar; a later read settles it
        from .normalize import result_from_terminal

        await self._finish(record.tenant, record.action_id, result_from_terminal(record.action_id, spec, terminal),
                           "acknowledged")

    async def _fail_never_admitted(self, record: ActionRecord) -> None:
        await self._finish(record.tenant, record.action_id, failed_result(
            record.action_id, ConnectorCancelledUnconfirmed(
                "the host restarted before the sidecar admitted the action", operation=record.operation,
                remote_status=404, uncertain_outcome=False, dispatch="not_sent"),
            dispatch="not_sent"), "not_sent")

    def _resume(self, record: ActionRecord) -> None:
        """Re-attach (once per process) to the sidecar job of a running streamed
        action no task here dispatches, i.e. one a previous host process left
        running. Read-only (:meth:`Dispatcher.resume`): never re-dispatched."""
        if self.live.get(record.tenant, record.action_id) is not None:
            return
        live = LiveAction(job=self._job(record, stream=True))
        self.live.add(live)
        live.task = asyncio.get_running_loop().create_task(self._follow_sidecar(live),
                                                           name=f"resume:{record.action_id}")

    async def _follow_sidecar(self, live: LiveAction) -> None:
        job = live.job
        tenant, action_id = job.tenant, job.action_id
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(action_id=action_id, tenant=tenant, crew_id=job.crew_id)
        sink = _ChunkSink(self.store, live)
        try:
            log.info("action_resumed", from_chunk=job.first_chunk_sequence)
            result = await self.dispatcher.resume(job, sink.add)
            await sink.drain()
            live.final = await self._finish(tenant, action_id, result, "acknowledged", operation=job.spec.name,
                                            durable=job.durable)
        except asyncio.CancelledError:
            sink.discard()
            raise
        except AipError as exc:
            with contextlib.suppress(Exception):
                await sink.drain()
            if exc.details.get("remote_status") == 404:  # the sidecar never admitted it
                record = await self.store.get_action(tenant, action_id)
                if record is not None:
                    await self._fail_never_admitted(record)
            else:  # the sidecar cannot be read now: the action stays running, the next read retries
                log.warning("action_resume_deferred", code=exc.code)
        except Exception:
            log.exception("action_resume_failed")
        finally:
            self.live.remove(tenant, action_id)
            live.notify()

    async def get(self, caller: Principal, action_id: str) -> ActionRecord:
        """The caller's tenant's action, refreshed. Raises ActionNotFound."""
        return await self.refresh(await self._get(caller.tenant, action_id))

    async def result(self, record: ActionRecord) -> ActionResult | None:
        """The AIP result of a record: stored when terminal, the approval
        reference when pending, None while running."""
        if record.result_json:
            return _result_decoder.decode(record.result_json)
        if record.status == "pending_approval" and record.approval_id:
            # Derived from the action row alone (the approval row may still be
            # in flight for a concurrent duplicate): same hash, same expiry.
            ref = ApprovalRef(approval_id=record.approval_id,
                              policy_hash=policy_hash(record.tenant, record.action_id, record.capability_id,
                                                      record.input_hash),
                              expires_at=ms_to_rfc3339(record.created_at + APPROVAL_TTL_MS))
            return ActionResult(action_id=record.action_id, status="pending_approval", approval=ref,
                                dispatch="not_sent")
        return None

    async def wait(self, record: ActionRecord, timeout_s: float) -> ActionRecord:
        """Wait until the action leaves ``running`` (or the timeout passes)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while record.status == "running":
            live = self.live.get(record.tenant, record.action_id)
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if live is not None:
                if live.task is not None:  # the end of the dispatch, not every chunk it stores
                    await asyncio.wait((live.task,), timeout=min(remaining, 5.0))
                else:
                    await live.wait(min(remaining, 5.0))
                if live.final is not None:  # the record its dispatch stored: no read needed
                    record = live.final
                    continue
            else:
                record = await self.refresh(await self._get(record.tenant, record.action_id))
                if record.status == "running":
                    await asyncio.sleep(min(remaining, 0.5))  # polling the sidecar via refresh
            record = await self._get(record.tenant, record.action_id)
        return record

    # --- approvals -------------------------------------------------------------

    async def on_decision(self, approval: ApprovalRecord) -> None:
        """Apply a recorded decision: approved → dispatch (re-checking TTL and
        binding); denied → the action fails with a policy error."""
        record = await self._get(approval.tenant, approval.action_id)
        if record.status != "pending_approval":
            return
        if approval.status == "denied":
            self._fence("approval", "denied")
            await self._finish(record.tenant, record.action_id,
                               failed_result(record.action_id, ApprovalDenied(), dispatch="not_sent"), "not_sent")
            return
        if not approval_admits(approval, record):
            self._fence("approval", "rejected_at_dispatch")
            await self._finish(record.tenant, record.action_id,
                               failed_result(record.action_id, ApprovalExpired(), dispatch="not_sent"), "not_sent")
            return
        self._fence("approval", "approved")
        # Approved and dispatched at once: `sent` ("the request may have reached the sidecar") is recorded with
        # the transition, in one durable commit instead of two; a connect failure then ends `not_sent` in the
        # result, exactly as when `sent` is written by the dispatch itself (dispatch never moves backward).
        if await self.store.update_action(record.tenant, record.action_id, from_statuses=["pending_approval"],
                                          status="running", dispatch="sent"):
            # The job is built from the input, key, crew and chunk count, which the transition left alone.
            self.start(dataclasses.replace(record, status="running", dispatch="sent"), stream=True)

    async def decide(self, approver: Principal, approval_id: str, decision: str, reason: str, now: int,
                     ) -> ApprovalRecord | None:
        """Record an approver's decision and apply it: an admitted approval
        starts its action in the same store commit (then the dispatch);
        a denial or a rejected approval fails the action (:meth:`on_decision`).

        Returns the decided approval, or None when this call did not decide
        it (already decided, expired, or the approver is the requester).
        """
        decided, started = await self.store.decide_and_start(approver.tenant, approval_id, decision, reason,
                                                             approver.id, now, start_if=approval_admits)
        if decided is None:
            return None
        if started is not None:
            self._fence("approval", "approved")
            self.start(started, stream=True)
        else:
            await self.on_decision(decided)
        return decided

    # --- cancellation ----------------------------------------------------------

    async def cancel(self, caller: Principal, action_id: str) -> ActionResult:
        """Runtime cancellation by the action's own tenant (DESIGN.md §8 table)."""
        record = await self.get(caller, action_id)
        spec = ops.get(record.operation)
        if record.status in TERMINAL:
            result = await self.result(record)
            if result is not None:
                return result
        if spec.name in ("memory_reset", "cancel"):
            raise NotCancellable(details={"operation": spec.name})
        if record.status == "pending_approval":
            result = ActionResult(action_id=action_id, status="cancelled", dispatch="not_sent",
                                  output={"remote_stop_confirmed": False, "provider_effect": "none"})
            await self._finish(record.tenant, action_id, result, None)
            return (await self.result(await self._get(record.tenant, action_id))) or result
        live = self.live.get(record.tenant, action_id)
        if spec.read_only:
            if live is not None and live.task is not None:
                live.task.cancel()
            output = {"remote_stop_confirmed": False, "provider_effect": "read_only", "completion_unobserved": True}
            if spec.name == "events":
                output = {"stream_detached": True, **output}
            result = ActionResult(action_id=action_id, status="cancelled", output=output,
                                  dispatch=record.dispatch)  # type: ignore[arg-type]
            await self._finish(record.tenant, action_id, result, None)
            return (await self.result(await self._get(record.tenant, action_id))) or result
        job = live.job if live is not None else self._job(record, stream=True)
        if live is not None and live.task is not None:
            await _until_answered(live)  # a start still in flight may be admitted after a cancel would arrive
        confirmed, view = await self.dispatcher.cancel_remote(job)
        if confirmed and live is not None and live.task is not None:
            # The sidecar records `cancelled`; the stream ends with it. Give it a moment, then detach.
            done, _ = await asyncio.wait({live.task}, timeout=10)
            if not done:
                live.task.cancel()
        record = await self._get(record.tenant, action_id)
        if record.status in TERMINAL:
            return (await self.result(record)) or ActionResult(action_id=action_id, status="cancelled")  # type: ignore[arg-type]
        ended = await self._ended_before_cancel(job, view) if confirmed else None
        if ended is not None:  # the job finished before the cancel reached it: its real outcome, not `cancelled`
            result = ended
        elif confirmed:
            output = {"remote_stop_confirmed": True,
                      "provider_stop_observed": bool((view or {}).get("provider_stop_observed", False))}
            result = ActionResult(action_id=action_id, status="cancelled", output=output, dispatch="acknowledged")
        else:
            if live is not None and live.task is not None:
                live.task.cancel()
            result = failed_result(action_id, ConnectorCancelledUnconfirmed(
                operation=spec.name, uncertain_outcome=True, dispatch=record.dispatch), dispatch=record.dispatch)
        await self._finish(record.tenant, action_id, result, None)
        return (await self.result(await self._get(record.tenant, action_id))) or result

    async def _ended_before_cancel(self, job: Job, view: dict[str, Any] | None) -> ActionResult | None:
        """The sidecar's own terminal result when the cancel found the job already
        completed or failed (None otherwise, or when it cannot be read)."""
        if (view or {}).get("status") not in ("completed", "failed"):
            return None
        from .normalize import result_from_terminal

        try:
            terminal = await self.dispatcher.terminal_event(job)
        except AipError:
            return None
        return None if terminal is None else result_from_terminal(job.action_id, job.spec, terminal)


async def _until_answered(live: LiveAction, bound_s: float = 10.0) -> None:
    """Wait (bounded) while the live dispatch's request is in flight (``sent``):
    the sidecar admits a job before it answers, so until then a cancel may get
    404 for a job that is admitted a moment later and then runs unseen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while live.job.dispatch.state == "sent" and live.task is not None and not live.task.done() \
            and loop.time() < deadline:
        await asyncio.sleep(0.005)


class _ChunkSink:
    """Stores a dispatch's chunks with group commit.

    The sidecar writes one SSE frame per event, so the stream yields about one
    event per read; a store transaction per read would cap a stream at a few
    thousand events per second. Chunks are queued instead and ONE writer task
    stores everything queued in one transaction (chunks, chunk count and the
    dispatch state together), then wakes the followers; events arriving during
    a write go into the next one, so batches grow with the rate. The stream is
    only held back (awaiting the writer) past :attr:`MAX_QUEUED` chunks.

    Chunk writes are not fsynced: like the sidecar's chunk checkpoints they
    become durable with the action's result commit (see :mod:`.store`).
    """

    MAX_QUEUED = 4096

    def __init__(self, store: Store, live: LiveAction) -> None:
        self.store = store
        self.live = live
        self._queued: list[StreamChunk] = []
        self._writer: asyncio.Task[None] | None = None

    async def add(self, chunks: list[StreamChunk]) -> None:
        """Queue ``chunks`` (in stream order); raises a previous write's error."""
        self._queued.extend(chunks)
        if self._writer is None or self._writer.done():
            if self._writer is not None:
                self._writer.result()
            self._writer = asyncio.get_running_loop().create_task(self._write())
        if len(self._queued) >= self.MAX_QUEUED:
            await asyncio.shield(self._writer)

    async def drain(self) -> None:
        """Wait until every queued chunk is stored; raises a write error."""
        if self._writer is not None:
            await asyncio.shield(self._writer)

    def discard(self) -> None:
        """Drop queued chunks and stop the writer (a batch already handed to the store may still land)."""
        self._queued.clear()
        if self._writer is not None:
            if self._writer.done() and not self._writer.cancelled():
                self._writer.exception()  # retrieved: the dispatch is being cancelled anyway
            self._writer.cancel()

    async def _write(self) -> None:
        job = self.live.job
        while self._queued:
            batch, self._queued = self._queued, []
            await self.store.append_chunks(job.tenant, job.action_id,
                                           [(c.sequence, _encode.encode(c).decode()) for c in batch],
                                           dispatch=job.dispatch.state, durable=False)
            self.live.notify()


def _idempotency_key(action_key: str | None, envelope_key: str | None) -> str | None:
    """The action's key (the envelope's as a fallback); both must agree.
    Keys are 1..512 UTF-8 bytes without control characters (DESIGN.md §7)."""
    if action_key is not None and envelope_key is not None and action_key != envelope_key:
        raise InvalidInput("$.body.action.idempotency_key", "differs from the envelope idempotency_key")
    key = action_key if action_key is not None else envelope_key
    if key is None:
        return None
    if not key or len(key.encode("utf-8")) > MAX_IDEMPOTENCY_KEY_BYTES or has_control_characters(key):
        raise InvalidInput("$.idempotency_key", f"1..{MAX_IDEMPOTENCY_KEY_BYTES} UTF-8 bytes, no control characters")
    return key


#: How often pending approvals are swept for expiry, seconds.
EXPIRY_SWEEP_S = 5.0
#: How long shutdown waits for in-flight dispatches, seconds, before cancelling them.
DRAIN_S = 20.0


async def _sweep_expired(service: ActionService) -> None:
    """Expire pending approvals whose TTL passed and fail their actions."""
    while True:
        await asyncio.sleep(EXPIRY_SWEEP_S)
        try:
            for approval in await service.store.expire_approvals(service.now_ms()):
                record = await service.store.get_action(approval.tenant, approval.action_id)
                if record is not None and record.status == "pending_approval":
                    await service._finish(record.tenant, record.action_id,
                                          failed_result(record.action_id, ApprovalExpired(), dispatch="not_sent"),
                                          "not_sent")
        except Exception:  # housekeeping must not kill the host
            log.exception("approval_sweep_failed")


async def _reconcile_all(service: ActionService) -> None:
    """After a restart: settle actions the previous process left running, and
    approvals it decided without applying the decision, or never wrote."""
    for record in [*await service.store.list_in_flight(), *await service.store.list_awaiting_approval()]:
        try:
            await service.refresh(record)
        except Exception:
            log.exception("reconcile_failed", action_id=record.action_id)


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """Build ``app.state.actions`` over the store and sidecar client the app
    lifespan opened; sweep approval expiry; reconcile after a restart; on
    shutdown, let in-flight dispatches finish for up to DRAIN_S seconds."""
    settings = app.state.settings
    client = SidecarClient(app.state.http, max_response_bytes=settings.max_response_bytes)
    allowed = {
        tenant: {crew: frozenset(operations) for crew, operations in app.state.capabilities.visible_crews(tenant).items()}
        for tenant in settings.tenants
    }
    service = ActionService(app.state.store, Dispatcher(client, max_response_bytes=settings.max_response_bytes),
                            allowed, metrics=app.state.metrics)
    app.state.actions = service
    tasks = [asyncio.create_task(_sweep_expired(service)), asyncio.create_task(_reconcile_all(service))]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        live = service.live.tasks()
        if live:
            log.info("draining_dispatches", count=len(live))
            _, pending = await asyncio.wait(live, timeout=DRAIN_S)
            for task in pending:
                task.cancel()
        await asyncio.gather(*tasks, *live, return_exceptions=True)
