"""The action service: capability resolution, the idempotency and approval
fences, dispatch in the background, cancellation and restart reconciliation.

HTTP handlers (``http/routes.py``, ``http/approvals.py``) stay thin over this. Cancellation lives in
:mod:`.cancellation`, restart reconciliation and the approval-expiry sweep in :mod:`.recovery`
(:class:`ActionService` delegates to both), chunk storage in :mod:`.chunk_sink`.

Source: ARCHITECTURE.md §7 (fences), §8 (cancellation outcomes).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import msgspec
import structlog

from ...contracts import operations as ops
from ...contracts.aip import Action, ActionResult, PendingApproval, TextPart
from ...contracts.errors import (
    ActionNotFound,
    AipError,
    ApprovalDenied,
    CapabilityNotFound,
    CapabilityRevoked,
    Forbidden,
    IdempotencyConflict,
    IdempotencyKeyRequired,
    Unauthenticated,
)
from ...contracts.hashing import canonical_json
from ...contracts.inputs import convert_input
from ...contracts.operations import OperationSpec
from ..auth.principals import FULL, Authenticator, Principal, action_access
from ..settings import DEFAULT_DISPATCH_DEADLINE_S
from ..sidecars.view_cache import DEFAULT_ENTRIES, ViewCache, is_final_view
from ..store.notify import RemoteChanges
from ..store.store import ActionRecord, ApprovalRecord, MissingTarget, Store, ms_to_rfc3339
from ..tracing import TraceRef, fence_decided
from . import cancellation, dispatch_task, recovery
from .dispatch import Dispatcher, Job
from .idempotency import IDEMPOTENCY_TTL_MS, checked_key, fence_hash, repeat_decision
from .lifecycle import ActionEvent, ActionState, ApprovalStatus, DispatchState, approval_admits, policy_hash
from .live import LiveAction, LiveRegistry
from .normalize import failed_result
from .writer import ActionWriter

__all__ = ["ActionService", "pending_result", "durable_action", "inline_read", "APPROVAL_TTL_MS"]

log = structlog.get_logger(__name__)

APPROVAL_TTL_MS = 900_000
#: Longest wait for another host's action between store reads when changes are pushed, seconds (a
#: missed notification costs at most this much delay).
REMOTE_POLL_S = 5.0
_result_decoder = msgspec.json.Decoder(ActionResult)
_view_encoder = msgspec.json.Encoder()


def pending_result(record: ActionRecord) -> ActionResult:
    """The ``pending_approval`` result of a governed action waiting for its approval: ``output`` is a
    :class:`~aip_crewai.contracts.aip.PendingApproval` (approval id, policy hash, expiry, where an approver
    decides), plus a text part. Derived from the action row alone (its approval row, written in the same
    transaction, holds the same hash and expiry). Pure.

    Source: docs/approvals.md "The approval flow"."""
    approval_id = record.approval_id or ""
    expires_at = ms_to_rfc3339(record.created_at + APPROVAL_TTL_MS)
    pending = PendingApproval(
        approval_id=approval_id,
        policy_hash=_approval_hash(record),
        expires_at=expires_at,
        approval_url=f"/aip/v1/approvals/{approval_id}",
    )
    text = f"{record.capability_id} needs an approval ({approval_id}) by an approver of the tenant before {expires_at}"
    return ActionResult(
        action_id=record.action_id, status="pending_approval", output=pending, message=[TextPart(text=text)]
    )


def _approval_hash(record: ActionRecord) -> str:
    return policy_hash(record.tenant, record.action_id, record.capability_id, record.input_hash)


def _request(
    caller: Principal, action: Action, crew_id: str, spec: OperationSpec, hashed: str
) -> tuple[str, str, str, str, str, str, str, str]:
    """An action row's who and what: tenant, action id, capability, crew, operation, input JSON, its hash, principal."""
    input_json = canonical_json(action.input).decode()
    return caller.tenant, action.id, action.capability_id, crew_id, spec.name, input_json, hashed, caller.id


def inline_read(spec: OperationSpec, key: str | None) -> bool:
    """Whether a blocking call of ``spec`` is answered in the request (:meth:`ActionService._read_inline`):
    a key-less read that needs no approval, starts nothing and streams nothing (``status``, an
    ``events`` page)."""
    return key is None and spec.read_only and not spec.approval and spec.name in ops.INSPECTION_OPERATIONS


def durable_action(spec: OperationSpec, key: str | None) -> bool:
    """Whether the store fsyncs an action's own writes: always, except for a read-only operation without an
    idempotency key (a ``status`` read), whose record a power loss may drop at no cost: no side effect, no
    fence rests on it, and the read is safe to repeat; a blocking one is written after its answer, so a host
    crash in between drops it too (ARCHITECTURE.md §9). Crashes lose no other write (:mod:`..store.store`)."""
    return not (spec.read_only and key is None)


class ActionService:
    """Admits, dispatches and reports actions for one host process.

    Args:
        store: the host store.
        dispatcher: runs jobs on the sidecar.
        allowed: tenant → {crew id → allowed operation names} (default deny:
            a crew absent for a tenant does not exist for it).
        metrics: the host :class:`~aip_crewai.host.metrics.Metrics` (optional).
        authenticator: claims the message ids of signed envelopes once a
            submission is authorized (None: a signed submission is refused).
        dispatch_deadline_s: how long a start the sidecar provably did not
            admit is retried, seconds, from the moment the action may run
            (admitted, or its approval decided): ARCHITECTURE.md §9.
        status_cache_entries: bound of :attr:`status_views`, the cache of final
            job views that answers a key-less ``:status`` of a final run without
            the sidecar hop (``[host] status_cache_entries``; 0 disables it).
            Each host process has its own (:mod:`.view_cache`).
    """

    def __init__(
        self,
        store: Store,
        dispatcher: Dispatcher,
        allowed: Mapping[str, Mapping[str, frozenset[str]]],
        *,
        metrics: Any = None,
        now_ms: Callable[[], int] | None = None,
        authenticator: Authenticator | None = None,
        principals: Mapping[str, Any] | None = None,
        dispatch_deadline_s: float = DEFAULT_DISPATCH_DEADLINE_S,
        status_cache_entries: int = DEFAULT_ENTRIES,
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.allowed = allowed
        self.live = LiveRegistry()
        dispatcher.placement.inflight = self.live.placed_on  # new jobs go where this host runs fewest
        #: Changes other hosts commit to a shared store, pushed to followers here (:mod:`.notify`).
        self.remote = RemoteChanges()
        self.metrics = metrics
        #: The one writer of action and approval state.
        self.writer = ActionWriter(store, metrics=metrics)
        self.authenticator = authenticator
        #: principal id -> configuration (``tenant``, ``roles``): a governed action runs only while its
        #: requester is still an invoker of its tenant (None: not checked).
        self.principals = principals
        self.now_ms = now_ms or store.now_ms
        self.dispatch_deadline_ms = int(dispatch_deadline_s * 1000)
        #: Actions created before this are a previous process's (no creator here may still be writing them).
        self.started_ms = self.now_ms()
        #: Final job views by (tenant, crew, run action id), for key-less ``:status`` reads (:meth:`_read_inline`).
        self.status_views = ViewCache(status_cache_entries)

    def _fence(self, fence: str, decision: str) -> None:
        fence_decided(self.metrics, fence, decision)  # counted, and an event of the current span

    # --- admission -------------------------------------------------------------

    def resolve(self, tenant: str, capability_id: str) -> tuple[str, OperationSpec]:
        """Resolve a capability for a tenant. Raises CapabilityNotFound (also
        for crews the tenant may not see: ARCHITECTURE.md §7)."""
        found = ops.resolve_capability(capability_id, self.allowed.get(tenant, {}))
        if found is None:
            raise CapabilityNotFound(capability_id)
        return found[0], ops.get(found[1])

    async def submit(
        self, caller: Principal, action: Action, envelope_key: str | None, *, stream: bool, blocking: bool = False
    ) -> ActionRecord:
        """Admit an action through both fences; start its dispatch when it may run.

        ``blocking``: the caller waits for the result (a ``sync`` call without
        a stream). A key-less read (:func:`inline_read`) is then answered in
        the request itself and recorded once, finished (:meth:`_read_inline`).

        Returns the action record (new, or the existing one for a repeat).

        Raises: CapabilityNotFound, InvalidInput, IdempotencyKeyRequired,
        IdempotencyConflict, ActionNotFound (inspection of an unknown run).
        """
        tenant = caller.tenant
        crew_id, spec = self.resolve(tenant, action.capability_id)
        await self._claim(caller)
        convert_input(spec.input_type, action.input)
        key = checked_key(action.idempotency_key, envelope_key)
        if key is None and spec.key is ops.KeyRequirement.REQUIRED:
            self._fence("idempotency", "key_missing")
            raise IdempotencyKeyRequired(details={"capability_id": action.capability_id})
        run_action_id = str(action.input["run_action_id"]) if "run_action_id" in action.input else None
        hashed = fence_hash(action.capability_id, action.input)
        event = ActionEvent.REQUEST_APPROVAL if spec.approval else ActionEvent.ADMIT
        # The approval id is fixed before the action row exists, so a concurrent
        # duplicate never sees a pending action without its approval reference.
        approval_id = "apr_" + secrets.token_urlsafe(16) if spec.approval else None
        if blocking and not stream and inline_read(spec, key):
            return await self._read_inline(caller, action, crew_id, spec, hashed)
        if (read := await self.writer.settled_read(tenant, action.id)) is not None:  # this host's, not yet written
            return await self._existing(read, action.id, hashed, key)
        if self.store.owner is None and run_action_id is None and self.live.get(tenant, action.id) is not None:
            # A re-call of an action dispatched here (its id is stored): what the create would find, one read.
            if (stored := await self.store.find_read(tenant, action.id, crew_id, caller.id, None, key)) is not None:
                return await self._existing(stored, action.id, hashed, key)
        placing = self.dispatcher.placement.placing(crew_id) if spec.startable and not spec.approval else None
        try:  # One transaction: the target check of status/events/cancel, the key's reservation, the action row and
            # its pending approval; a request refused here reserves nothing (docs/security.md "Security": idempotency).
            # A running action is dispatched right after: created `sent` with its placement (operating.md "Several sidecars").
            with placing or contextlib.nullcontext() as sidecar:
                created, record_ = await self.writer.create(
                    event,
                    *_request(caller, action, crew_id, spec, hashed),
                    key,
                    approval_id=approval_id,
                    timeout_ms=action.timeout_ms,
                    dispatch=DispatchState.SENT if event is ActionEvent.ADMIT else DispatchState.NOT_SENT,
                    target=(run_action_id, ops.STARTABLE_OPERATIONS) if run_action_id is not None else None,
                    key_expires_at=self.now_ms() + IDEMPOTENCY_TTL_MS if key is not None else None,
                    durable=durable_action(spec, key),
                    sidecar=sidecar,
                    approval_ttl_ms=APPROVAL_TTL_MS if approval_id is not None else None,
                )
        except MissingTarget:
            raise ActionNotFound(run_action_id=run_action_id) from None
        if not created:
            return await self._existing(record_, action.id, hashed, key)
        self._fence("idempotency", "admitted")
        if approval_id is not None:
            self._fence("approval", "requested")
            return record_
        self.start(record_, stream=stream)
        return record_

    async def _existing(self, record: ActionRecord, action_id: str, hashed: str, key: str | None) -> ActionRecord:
        """A submission that found ``record`` stored (its action id, or its key's live reservation):
        the same intent replays it, refreshed; another raises IdempotencyConflict
        (:func:`.idempotency.repeat_decision`)."""
        try:
            decision = repeat_decision(record, action_id, hashed, key)
        except IdempotencyConflict:
            self._fence("idempotency", "conflict")
            raise
        self._fence("idempotency", decision)
        return await self.refresh(record)

    async def _read_inline(
        self, caller: Principal, action: Action, crew_id: str, spec: OperationSpec, hashed: str
    ) -> ActionRecord:
        """Answer a key-less read (``status``, or an ``events`` page) in the request, recorded after its answer.

        One read of an action id at a time on this host (:meth:`ActionWriter.claim_read`: a repeat waits,
        then replays). Side by side: the store's one read (:meth:`Store.find_read`: the target check, the
        caller's own run of this crew, ActionNotFound if not; and whether the action id is stored: a repeat)
        and the sidecar's answer. Then the read is answered with the record ONE write stores after the
        answer, finished (not durable: :meth:`ActionWriter.record_answered`). A ``status`` of a run whose
        view this host already read final (:func:`.view_cache.is_final_view`) is answered from
        :attr:`status_views` (dispatch ``acknowledged``) without the sidecar hop; a view enters the cache only
        from the sidecar's own successful answer, after its target check passed.
        Source: ARCHITECTURE.md §9 (a key-less read answered inline; the final-view cache)."""
        tenant, run_action_id = caller.tenant, str(action.input["run_action_id"])
        job = Job(tenant, action.id, crew_id, spec, dict(action.input), action.id, action.timeout_ms, durable=False)
        structlog.contextvars.bind_contextvars(action_id=action.id, crew_id=crew_id)
        if (pending := await self.writer.claim_read(tenant, action.id)) is not None:
            return await self._existing(pending, action.id, hashed, None)
        target, cache_key = (run_action_id, ops.STARTABLE_OPERATIONS), (tenant, crew_id, run_action_id)
        found = asyncio.ensure_future(self.store.find_read(tenant, action.id, crew_id, caller.id, target))
        found.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved in any case
        cached = self.status_views.get(cache_key) if spec.name == "status" and self.status_views.enabled else None
        fresh_view: bytes | None = None
        try:
            if cached is not None:
                self._count_status_cache("hit")
                result = ActionResult(action_id=action.id, status="completed", output=msgspec.Raw(cached))
                job.dispatch.state = DispatchState.ACKNOWLEDGED
            else:
                if spec.name == "status" and self.status_views.enabled:
                    self._count_status_cache("miss")
                try:
                    result = await self.dispatcher.run(job, dispatch_task.no_chunks)
                    if spec.name == "status" and result.error is None and is_final_view(result.output):
                        fresh_view = _view_encoder.encode(result.output)
                    result = await dispatch_task.answer_before_admission(self, job, result)
                except Exception:  # a host bug answers a typed failure, recorded like any other result
                    log.exception("dispatch_crashed")
                    result = failed_result(action.id, AipError("the host failed while dispatching the action"))
            if (stored := await found) is not None:
                return await self._existing(stored, action.id, hashed, None)
            answered = self.writer.answered(
                *_request(caller, action, crew_id, spec, hashed),
                result,
                job.dispatch.state,
                now=self.now_ms(),
                timeout_ms=action.timeout_ms,
                target=target,
            )
            await self.writer.record_answered(answered)
        except MissingTarget:
            raise ActionNotFound(run_action_id=run_action_id) from None
        finally:
            found.cancel()  # a request gone before the read ended (done: no effect)
            self.writer.release_read(tenant, action.id)  # unless answered: a repeat waiting goes on
        if fresh_view is not None:  # the target check passed: the caller's own run
            self.status_views.put(cache_key, fresh_view)
        self._fence("idempotency", "admitted")
        return answered.record

    def _count_status_cache(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.status_cache.inc(result=result)

    async def _claim(self, caller: Principal) -> None:
        """Claim a signed envelope's message id for its key, now that the caller's role
        (checked by the handler) and capability (:meth:`resolve`) authorize it
        (docs/security.md "Security": signed message ids).

        Raises: Unauthenticated (a replayed id, or no authenticator to claim with).
        """
        if caller.message_claim is None:
            return
        try:
            if self.authenticator is None:
                raise Unauthenticated("signed envelopes need the store")
            await self.authenticator.claim(caller)
        except Unauthenticated as exc:
            if self.metrics is not None:
                self.metrics.auth_failures.inc()
            log.info("authentication_failed", reason=exc.message)
            raise

    async def record(self, tenant: str, action_id: str) -> ActionRecord:
        """The stored action as it is (no refresh). Raises ActionNotFound."""
        # a read answered inline is this host's before its write: asked first, its write may end meanwhile
        record = self.writer.pending_answer(tenant, action_id) or await self.store.get_action(tenant, action_id)
        if record is None:
            raise ActionNotFound(action_id)
        return record

    # --- dispatch --------------------------------------------------------------

    def job(self, record: ActionRecord, *, stream: bool) -> Job:
        """The dispatch job of a stored action (``stream``: use the SSE route)."""
        return Job(
            tenant=record.tenant,
            action_id=record.action_id,
            crew_id=record.crew_id,
            spec=ops.get(record.operation),
            input=msgspec.json.decode(record.input_json),
            idempotency_key=record.idempotency_key or record.action_id,
            timeout_ms=record.timeout_ms,
            stream=stream or ops.get(record.operation).name != "events",
            first_chunk_sequence=record.chunk_count,
            durable=durable_action(ops.get(record.operation), record.idempotency_key),
            trace=TraceRef.of(record),
            sidecar=record.sidecar,
        )

    def start(self, record: ActionRecord, *, stream: bool = False, rechecked: bool = False) -> LiveAction:
        """Start the background dispatch of a running action (once per process)."""
        live = self.live.get(record.tenant, record.action_id)
        if live is not None:
            return live
        live = LiveAction(job=self.job(record, stream=stream))
        self.live.add(live)
        dispatch = dispatch_task.run(
            self, live, mark_sent=record.dispatch == DispatchState.NOT_SENT, recheck=not rechecked
        )
        live.task = asyncio.get_running_loop().create_task(dispatch, name=f"dispatch:{record.action_id}")
        return live

    # --- reading ---------------------------------------------------------------

    async def refresh(self, record: ActionRecord) -> ActionRecord:
        """Bring a record up to date: expire a stale approval; reconcile a
        running action nobody in this process dispatches (a host restart) with
        the sidecar's job, never re-dispatching it; correct a stored result
        that is not final from the sidecar's job (ARCHITECTURE.md §9 "Final
        results"; bounded by :data:`.recovery.CORRECT_BOUND_S`)."""
        if record.status == ActionState.PENDING_APPROVAL and record.approval_id:
            approval = await self.store.get_approval(record.tenant, record.approval_id)
            if approval is None and record.created_at < self.started_ms:
                # A previous process died between writing the action and its approval.
                approval = await self.writer.restore_approval(
                    record, _approval_hash(record), record.created_at + APPROVAL_TTL_MS
                )
            if approval is not None and approval.effective_status(self.now_ms()) is ApprovalStatus.EXPIRED:
                await self.expire_due()  # this one's and every other due approval's action
                await self.writer.expire(record.tenant, record.action_id)
                return await self.record(record.tenant, record.action_id)
            if approval is not None and approval.status in (ApprovalStatus.APPROVED, ApprovalStatus.DENIED):
                await self.on_decision(approval)  # decided by a process that died before applying the decision
                return await self.record(record.tenant, record.action_id)
        if record.status == ActionState.RUNNING and self.live.get(record.tenant, record.action_id) is None:
            # Only the holder of its dispatch lease settles it: another live host's action is left to it
            # (ARCHITECTURE.md §10, dispatch leases); an expired lease (a dead host's) is taken over here.
            if self.store.lease_is_foreign(record) or not await self.store.take_lease(record.tenant, record.action_id):
                return record
            await self.reconcile(record, lease_token=self.store.lease_token(record.tenant, record.action_id))
            return await self.record(record.tenant, record.action_id)
        if record.status == ActionState.FAILED and not recovery.is_final(record, await self.result(record)):
            # A provisional result: re-read from the sidecar, within a bound (a frozen sidecar must not hold reads).
            with contextlib.suppress(TimeoutError):
                with anyio.fail_after(recovery.CORRECT_BOUND_S):
                    corrected = await recovery.correct(self, record)
                if corrected is not None:
                    return corrected
            # Nothing changed here, but a concurrent correction (the reconciler's, another host's) may have
            # replaced the result this read started from: answer what is stored now, never the stale row.
            return await self.record(record.tenant, record.action_id)
        return record

    async def expire_due(self) -> None:
        """Expire every due approval and fail its pending action (all paths that expire approvals come here)."""
        await self.writer.expire_due(self.now_ms())

    async def reconcile(self, record: ActionRecord, *, lease_token: int | None = None) -> None:
        """Settle a running action left by a previous host process, under ``lease_token`` (:func:`.recovery.reconcile`)."""
        await recovery.reconcile(self, record, lease_token=lease_token)

    async def access(self, caller: Principal, record: ActionRecord) -> str | None:
        """What ``caller`` may read of ``record`` (:func:`~.auth.action_access`): ``full``, ``metadata`` or None."""
        decided = False
        if caller.has_role("approver") and record.approval_id:
            approval = await self.store.get_approval(record.tenant, record.approval_id)
            decided = approval is not None and approval.decided_by == caller.id
        return action_access(caller, submitted=record.principal_id == caller.id, decided=decided)

    async def read(self, caller: Principal, action_id: str) -> tuple[ActionRecord, str]:
        """The caller's tenant's action, refreshed, with what the caller may read of it.

        Raises: ActionNotFound (not the tenant's, or nothing the caller may read)."""
        record = await self.record(caller.tenant, action_id)
        level = await self.access(caller, record)
        if level is None:
            raise ActionNotFound(action_id)
        return await self.refresh(record), level

    async def get(self, caller: Principal, action_id: str) -> ActionRecord:
        """The caller's tenant's action, refreshed, when the caller may read all of it.

        Raises: ActionNotFound (not the tenant's, or not the caller's to read);
        Forbidden (an operator: metadata only)."""
        record, level = await self.read(caller, action_id)
        if level != FULL:
            raise Forbidden("operators read action metadata only (GET /aip/v1/actions/{id})")
        return record

    async def result(self, record: ActionRecord) -> ActionResult | None:
        """The AIP result of a record: stored when terminal, the approval
        reference when pending, None while running."""
        if record.result_json:
            return _result_decoder.decode(record.result_json)
        if record.status == ActionState.PENDING_APPROVAL and record.approval_id:
            # Derived from the action row alone (the approval row may still be
            # in flight for a concurrent duplicate): same hash, same expiry.
            return pending_result(record)
        return None

    async def wait(self, record: ActionRecord, timeout_s: float) -> ActionRecord:
        """Wait until the action leaves ``running``, or is queued for a retry of a start the sidecar did not
        admit (ARCHITECTURE.md §9), or the timeout passes; returns the record as it then is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while record.status == ActionState.RUNNING:
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
                if live.retry_waiting:  # queued for a retry of its start: answer now, the caller follows it
                    return await self.record(record.tenant, record.action_id)
            else:
                remote = self.remote.signal(record.tenant, record.action_id)  # before the read (wakeup rule)
                seen = remote.version
                record = await self.refresh(await self.record(record.tenant, record.action_id))
                if record.status == ActionState.RUNNING:
                    # Another host's action (a shared store pushes its changes) or one to poll via refresh.
                    await remote.wait(min(remaining, REMOTE_POLL_S if self.remote.pushed else 0.5), seen=seen)
            record = await self.record(record.tenant, record.action_id)
        return record

    # --- approvals -------------------------------------------------------------

    async def on_decision(self, approval: ApprovalRecord) -> None:
        """Apply a recorded decision: approved → dispatch (re-checking TTL and
        binding); denied → the action fails with a policy error."""
        record = await self.record(approval.tenant, approval.action_id)
        if record.status != ActionState.PENDING_APPROVAL:
            return
        if approval.status is ApprovalStatus.DENIED:
            self._fence("approval", "denied")
            await self.writer.finish(
                record.tenant,
                record.action_id,
                failed_result(record.action_id, ApprovalDenied()),
                DispatchState.NOT_SENT.value,
                event=ActionEvent.DENY,
            )
            return
        if not approval_admits(approval, record):
            self._fence("approval", "rejected_at_dispatch")
            await self.writer.expire(record.tenant, record.action_id)
            return
        self._fence("approval", "approved")
        # Approved and dispatched at once: `sent` ("the request may have reached the sidecar") is recorded with
        # the transition, in one durable commit instead of two; a connect failure then ends `not_sent` in the
        # result, exactly as when `sent` is written by the dispatch itself (dispatch never moves backward).
        started = await self.writer.approve(record)
        if started is not None:
            self.start(started, stream=True)

    def revocation(self, record: ActionRecord) -> CapabilityRevoked | None:
        """Why a governed action may no longer run, or None: its capability no
        longer resolves to the same crew and operation for its tenant (routing
        or the crew's operations changed), or its requester is no longer an
        invoker of the tenant. Checked at decision time and again at dispatch
        (docs/security.md "Security": revocation). Pure over the configuration."""
        found = ops.resolve_capability(record.capability_id, self.allowed.get(record.tenant, {}))
        if found != (record.crew_id, record.operation):
            return CapabilityRevoked(details={"capability_id": record.capability_id, "reason": "capability"})
        if self.principals is not None:
            requester = self.principals.get(record.principal_id)
            if requester is None or requester.tenant != record.tenant or "invoker" not in requester.roles:
                return CapabilityRevoked(details={"capability_id": record.capability_id, "reason": "requester"})
        return None

    async def _fail_revoked(self, record: ActionRecord, error: CapabilityRevoked) -> None:
        self._fence("approval", "revoked")
        await self.writer.finish(
            record.tenant,
            record.action_id,
            failed_result(record.action_id, error),
            DispatchState.NOT_SENT.value,
            event=ActionEvent.FAIL,
        )

    async def decide(
        self,
        approver: Principal,
        approval_id: str,
        decision: str,
        reason: str,
        now: int,
        *,
        proof: str | None = None,
        action: ActionRecord | None = None,
    ) -> ApprovalRecord | None:
        """Record an approver's decision and apply it: an admitted approval starts its action in the same
        store commit (then the dispatch); a denial or a rejected approval fails the action (:meth:`on_decision`).

        Returns the decided approval, or None when this call did not decide it (already decided, expired, or
        the approver is the requester). ``proof``: the JSON proof of a signed decision, stored with it.
        ``action``: the approval's action as the caller just read it (``Store.get_approval_and_action``),
        its revocation checked on it without reading it again; None: read here.

        Raises: CapabilityRevoked (403) for an approval of an action that may
        no longer run (:meth:`revocation`); the action fails with it first.
        """
        record = action or (await self.store.get_approval_and_action(approver.tenant, approval_id))[1]
        if decision == ApprovalStatus.APPROVED and record is not None and record.status == ActionState.PENDING_APPROVAL:
            revoked = self.revocation(record)
            if revoked is not None:
                await self._fail_revoked(record, revoked)
                raise revoked
        decided, started = await self.writer.decide(approver, approval_id, decision, reason, now, proof=proof)
        if decided is None:
            return None
        if started is not None:
            self._fence("approval", "approved")
            self.start(started, stream=True, rechecked=True)  # revocation was checked just above
        else:
            await self.on_decision(decided)
        return decided

    # --- cancellation ----------------------------------------------------------

    async def cancel(self, caller: Principal, action_id: str) -> ActionResult:
        """Runtime cancellation by the action's own tenant (ARCHITECTURE.md §8 table; :func:`.cancellation.cancel`)."""
        return await cancellation.cancel(self, caller, action_id)
