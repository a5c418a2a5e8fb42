"""The one writer of action and approval state, and the runtime interface the
lifecycle functions work over.

:class:`ActionWriter` is the only code that changes an action's state or an
approval's status (a test checks no other module calls the store's state
writes). Every method names the :class:`~aip_crewai.host.actions.lifecycle.ActionEvent`
it applies, checks it against the lifecycle table, and leaves the source-state
check to the storage ``WHERE`` clause, so a stale writer changes nothing.
The writes of a dispatch (:meth:`~ActionWriter.mark_sent`, :meth:`~ActionWriter.requeue`,
:meth:`~ActionWriter.finish`, :meth:`~ActionWriter.correct`) take the fencing token it dispatches under
(``lease_token``): the store refuses them (``LeaseLost``, nothing written, the result's usage and receipt
included) once that token is not current (ARCHITECTURE.md §10, dispatch leases).

:class:`ActionRuntime` is what :mod:`.cancellation` and :mod:`.recovery`
need from the action service (the writer, the dispatcher, the live registry
and a few reads); they import this Protocol, never the service, so no
module imports back into :mod:`.actions`.

Source: docs/ARCHITECTURE.md "Action states", "Storage".
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import structlog

from ...contracts.aip import ActionResult, StreamChunk
from ...contracts.errors import ApprovalExpired, CapabilityRevoked
from ...tracing import current_traceparent
from ..auth.principals import Principal
from ..ledger.sealer import ResultSeal, Sealer
from ..store.store import (
    ActionRecord,
    ApprovalRecord,
    MissingTarget,
    SealedRows,
    Store,
    StoreError,
    StoreUnavailable,
)
from .dispatch import Dispatcher, Job
from .lifecycle import (
    CORRECTION_EVENTS,
    RESULT_EVENTS,
    TRANSITIONS,
    ActionEvent,
    ActionState,
    DispatchState,
    approval_admits,
    policy_hash,
)
from .live import LiveAction, LiveRegistry
from .normalize import failed_result

log = structlog.get_logger(__name__)

_encode = msgspec.json.Encoder()
#: Reads answered before their record is written, at most, per host process; one more waits for its own
#: write before its answer (:meth:`ActionWriter.record_answered`; docs/ARCHITECTURE.md §9).
MAX_UNWRITTEN_ANSWERS = 256


def _rows(chunks: Sequence[StreamChunk]) -> list[tuple[int, str]]:
    """``(sequence, chunk_json)`` pairs of ``chunks``, as the store keeps them (:class:`.chunk_sink.ChunkSink`)."""
    return [(c.sequence, _encode.encode(c).decode()) for c in chunks]


@dataclass(frozen=True)
class Answered:
    """A key-less read answered inline, before its write (:meth:`ActionWriter.answered`): its ``record``
    as it will be stored, the ``result`` it holds, the ``seal`` and the ``rows`` it computed (written with the
    record), and the ``target`` check of the write ``(run_action_id, operations)``."""

    record: ActionRecord
    result: ActionResult
    seal: ResultSeal
    rows: SealedRows | None
    target: tuple[str, Sequence[str]] | None


def _sources(event: ActionEvent, only_from: ActionState | None = None) -> list[str]:
    sources = [s.value for s in TRANSITIONS[event].sources if only_from in (None, s)]
    if not sources:
        raise ValueError(f"{event.value} cannot start from {only_from}")
    return sources


class ActionWriter:
    """Applies lifecycle events to the host store.

    Args:
        store: the host store.
        metrics: the host :class:`~aip_crewai.host.metrics.Metrics` (optional):
            every stored result is counted by operation and status.
        sealer: adds ``usage`` and, once final, a signed receipt to every stored result, in its own
            write (docs/observing.md "Observing actions"); default: usage without prices, no receipts.
    """

    def __init__(self, store: Store, *, metrics: Any = None, sealer: Sealer | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.sealer = sealer if sealer is not None else Sealer(metrics=metrics)
        #: key-less reads in flight or answered and not yet written, by (tenant, action id): their record once
        #: answered, None if they ended without one (:meth:`claim_read`); and their writes (:meth:`record_answered`)
        self._answered: dict[tuple[str, str], asyncio.Future[ActionRecord | None]] = {}
        self._answering: set[asyncio.Future[None]] = set()
        #: at most this many reads answered before their write (:meth:`record_answered`)
        self.max_unwritten = MAX_UNWRITTEN_ANSWERS
        #: the last such write found the store unavailable: reads write before their answer until one succeeds
        self._failing = False

    async def create(
        self,
        event: ActionEvent,
        tenant: str,
        action_id: str,
        capability_id: str,
        crew_id: str,
        operation: str,
        input_json: str,
        input_hash: str,
        principal_id: str,
        key: str | None,
        *,
        approval_id: str | None = None,
        timeout_ms: int | None = None,
        dispatch: DispatchState = DispatchState.NOT_SENT,
        target: tuple[str, Sequence[str]] | None = None,
        key_expires_at: int | None = None,
        durable: bool = True,
        sidecar: str | None = None,
        approval_ttl_ms: int | None = None,
    ) -> tuple[bool, ActionRecord]:
        """``request_approval`` or ``admit``: insert the action and reserve its
        idempotency key in one transaction (see :meth:`Store.create_action`), with the W3C
        ``traceparent`` current here, which its dispatch continues (:mod:`..tracing`), and
        its placement ``sidecar`` when it is dispatched at once (docs/operating.md "Several sidecars").
        ``approval_ttl_ms``: ``request_approval``'s pending approval (``approval_id``, its policy hash) is
        written in the same transaction, expiring this long after the row's ``created_at``."""
        if TRANSITIONS[event].sources:
            raise ValueError(f"{event.value} does not create an action")
        now = self.store.now_ms()
        approval = None
        if approval_ttl_ms is not None:  # only a governed action's creation hashes its approval's policy
            approval = (policy_hash(tenant, action_id, capability_id, input_hash), now + approval_ttl_ms)
        return await self.store.create_action(
            tenant,
            action_id,
            capability_id,
            crew_id,
            operation,
            input_json,
            input_hash,
            principal_id,
            key,
            TRANSITIONS[event].target.value,
            approval_id=approval_id,
            timeout_ms=timeout_ms,
            dispatch=dispatch.value,
            target=target,
            key_expires_at=key_expires_at,
            durable=durable,
            trace_parent=current_traceparent(),
            sidecar=sidecar,
            approval=approval,
            now=now,
        )

    def answered(
        self,
        tenant: str,
        action_id: str,
        capability_id: str,
        crew_id: str,
        operation: str,
        input_json: str,
        input_hash: str,
        principal_id: str,
        result: ActionResult,
        dispatch: str,
        *,
        now: int | None = None,
        timeout_ms: int | None = None,
        target: tuple[str, Sequence[str]] | None = None,
    ) -> Answered:
        """A key-less read answered inline, as :meth:`write_answered` will store it: the record that
        ``admit`` and the result's own event (``complete`` or ``fail``) leave in ONE write, created and
        finished at ``now`` (ms; default: the store's clock now), with its seal already applied (``usage``,
        a receipt). Pure but for the seal's receipt signature. Raises ValueError for a result the lifecycle
        cannot store so."""
        event = RESULT_EVENTS[result.status]
        admitted = TRANSITIONS[ActionEvent.ADMIT].target
        if admitted not in TRANSITIONS[event].sources or TRANSITIONS[event].target.value != result.status:
            raise ValueError(f"{event.value} cannot follow admit with a {result.status} result")
        result, seal = self.sealer.seal_answered(result, operation=operation, crew_id=crew_id)
        request = (tenant, action_id, capability_id, crew_id, operation, input_json, input_hash, principal_id)
        now = self.store.now_ms() if now is None else now
        status, result_json = ActionState(result.status), _encode.encode(result).decode()
        record = ActionRecord(
            *request, None, status, DispatchState(dispatch), result_json, None, None, timeout_ms, 0, now, now
        )
        rows = seal(record, None)  # what the store writes with the row (:func:`..store.ledger.seal_now`)
        if rows is not None:
            record = dataclasses.replace(record, result_json=rows.result_json)
        return Answered(record, result, seal, rows, target)

    async def write_answered(self, answered: Answered) -> tuple[bool, ActionRecord]:
        """Store an :meth:`answered` read (not durable: see ``actions.durable_action``), with what its seal
        computed. Same returns and raises as :meth:`Store.create_action`."""
        record, result = answered.record, answered.result
        created, stored = await self.store.create_action(
            record.tenant,
            record.action_id,
            record.capability_id,
            record.crew_id,
            record.operation,
            record.input_json,
            record.input_hash,
            record.principal_id,
            None,
            ActionState.RUNNING.value,
            timeout_ms=record.timeout_ms,
            dispatch=record.dispatch.value,
            target=answered.target,
            durable=False,
            result=(result.status, record.result_json or ""),
            seal=lambda _record, _proof: answered.rows,
            now=record.created_at,
        )
        log.info("action_finished", status=result.status, changed=created)
        if created:
            self._count(record.operation, result)
            self.sealer.count(answered.seal)
        return created, stored

    async def claim_read(self, tenant: str, action_id: str) -> ActionRecord | None:
        """Before a key-less read of ``action_id`` is answered inline: one such read per action id at a time
        on this host. Waits for one in flight here; returns its record if it was answered (a repeat, to
        replay), else claims the id for the caller (None), who ends the claim with :meth:`record_answered`
        or :meth:`release_read`. Source: ARCHITECTURE.md §9 (a key-less read answered inline)."""
        key = (tenant, action_id)
        while (flight := self._answered.get(key)) is not None:
            if (record := await asyncio.shield(flight)) is not None:
                return record
        self._answered[key] = asyncio.get_running_loop().create_future()
        return None

    async def settled_read(self, tenant: str, action_id: str) -> ActionRecord | None:
        """For any other submission of ``action_id``, before it creates its action: the record of a read of
        that id this host answered and has not written yet, once a read in flight here ended; else None."""
        flight = self._answered.get((tenant, action_id))
        return None if flight is None else await asyncio.shield(flight)

    def release_read(self, tenant: str, action_id: str) -> None:
        """End a :meth:`claim_read` that was not answered (refused, failed, cancelled; after an answer: no
        effect): a repeat waiting for it goes on."""
        flight = self._answered.get((tenant, action_id))
        if flight is not None and not flight.done():
            flight.set_result(None)
            del self._answered[(tenant, action_id)]

    async def record_answered(self, answered: Answered) -> None:
        """Answer a claimed read (:meth:`claim_read`) with :meth:`answered`'s record and write that record
        after the answer, in a task of its own: until the write ends, :meth:`pending_answer` holds it (this
        host's reads of it, and a repeat of its action id, find it). A write that fails is logged
        (``answered_read_unrecorded``): the read changed nothing. :meth:`drain_answered` waits for these
        writes. Written here instead, before the answer: a record with a signed receipt (its reference is
        never answered before the receipt is stored), any while the last such write found the store
        unavailable, and any with :attr:`max_unwritten` writes still running (a store slower than the reads:
        backpressure, not a growing backlog). A write the store fails drops those waiting (:meth:`_shed`).
        Source: ARCHITECTURE.md §9 (a key-less read answered inline)."""
        key = (answered.record.tenant, answered.record.action_id)
        flight = self._answered.get(key)
        if flight is None or flight.done():  # not claimed: this answer claims the id now
            flight = self._answered[key] = asyncio.get_running_loop().create_future()
        receipt = answered.rows is not None and answered.rows.receipt is not None
        if receipt or self._failing or len(self._answering) >= self.max_unwritten:
            try:  # a repeat waiting here replays the record once written
                await self._write_later(key, answered)
            except BaseException:  # cancelled mid-write: a repeat reads the store itself
                flight.set_result(None)
                raise
            flight.set_result(answered.record)
            return
        flight.set_result(answered.record)
        task = asyncio.ensure_future(self._write_later(key, answered))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _write_later(self, key: tuple[str, str], answered: Answered) -> None:
        try:
            created, _ = await self.write_answered(answered)
            self._failing = False
            if not created:  # another host stored a read under this action id first: it stands
                log.info("answered_read_raced")
        except MissingTarget:  # not expected (no run is ever deleted): the store's own check refused it
            log.warning("answered_read_unrecorded", reason="target_gone")
        except StoreUnavailable:
            log.warning("answered_read_unrecorded", reason="store_unavailable")
            self._failing = True
            self._shed()
        except Exception:
            log.exception("answered_read_unrecorded", reason="error")
        finally:
            self._answered.pop(key, None)

    def _shed(self) -> None:
        """The store failed a write: drop the writes still waiting behind it (a store that stops answering
        would otherwise hold every other store call behind each of them; one already on the store's thread
        runs to its end). Reads then write before their answer while the store is unavailable."""
        current = asyncio.current_task()
        shed = [task for task in self._answering if task is not current and not task.done()]
        for task in shed:
            task.cancel()
        if shed:
            log.warning("answered_reads_shed", count=len(shed))

    def pending_answer(self, tenant: str, action_id: str) -> ActionRecord | None:
        """The record of a read this host answered and is still writing (:meth:`record_answered`), else None."""
        flight = self._answered.get((tenant, action_id))
        return flight.result() if flight is not None and flight.done() else None

    async def drain_answered(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s`` seconds, for the writes :meth:`record_answered` started (at shutdown);
        those still running then are dropped and counted (``answered_reads_unwritten``)."""
        if self._answering:
            _, late = await asyncio.wait(set(self._answering), timeout=timeout_s)
            if late:  # dropped, so the store closes after the one call on its thread at most
                log.warning("answered_reads_unwritten", count=len(late))
                for task in late:
                    task.cancel()
                await asyncio.wait(late)

    def _count(self, operation: str, result: ActionResult) -> None:
        """Count a stored result by operation and status (and a connector error by code)."""
        if self.metrics is None:
            return
        self.metrics.actions.inc(operation=operation, status=result.status)
        if result.error is not None and result.error.code.startswith("connector."):
            self.metrics.stream_errors.inc(code=result.error.code)

    async def open_approval(self, record: ActionRecord, approval_hash: str, expires_at: int) -> ApprovalRecord:
        """The pending approval of a ``pending_approval`` action (its row already names the id)."""
        return await self.store.create_approval(
            record.tenant,
            record.approval_id or "",
            record.action_id,
            record.capability_id,
            approval_hash,
            record.principal_id,
            record.input_json,
            expires_at,
        )

    async def restore_approval(
        self, record: ActionRecord, approval_hash: str, expires_at: int
    ) -> ApprovalRecord | None:
        """Write the approval a pending action points at, exactly as admission
        would have; a concurrent writer's row wins (then it is read back)."""
        try:
            return await self.open_approval(record, approval_hash, expires_at)
        except StoreError:
            return await self.store.get_approval(record.tenant, record.approval_id or "")

    async def mark_sent(
        self,
        tenant: str,
        action_id: str,
        *,
        durable: bool = True,
        sidecar: str | None = None,
        lease_token: int | None = None,
    ) -> ActionRecord | None:
        """``mark_sent``: the request may have reached the sidecar; ``sidecar``: the one it is placed on,
        recorded before the start is sent (docs/operating.md "Several sidecars"; None keeps the stored placement).
        ``lease_token``: the dispatch's fencing token (:meth:`Store.update_action`). Raises LeaseLost: that
        token is not current (nothing written, nothing may be sent)."""
        return await self.store.update_action(
            tenant,
            action_id,
            from_statuses=_sources(ActionEvent.MARK_SENT),
            status=TRANSITIONS[ActionEvent.MARK_SENT].target.value,
            dispatch=DispatchState.SENT.value,
            durable=durable,
            sidecar=sidecar,
            lease_token=lease_token,
        )

    async def requeue(
        self, tenant: str, action_id: str, *, durable: bool = True, lease_token: int | None = None
    ) -> ActionRecord | None:
        """``requeue``: the sidecar provably did not admit the start (no
        connection, 503 before admission, 507), so the running action waits
        for its retry with dispatch ``not_sent`` again (tenants see
        ``queued``; ARCHITECTURE.md §9). Returns the record, or None when it
        is no longer running (a cancel won). ``lease_token``: the dispatch's fencing token
        (:meth:`Store.update_action`); raises LeaseLost when it is not current (nothing written)."""
        return await self.store.update_action(
            tenant,
            action_id,
            from_statuses=_sources(ActionEvent.REQUEUE),
            status=TRANSITIONS[ActionEvent.REQUEUE].target.value,
            dispatch=DispatchState.NOT_SENT.value,
            durable=durable,
            settle_dispatch=True,
            lease_token=lease_token,
        )

    async def correct(
        self,
        record: ActionRecord,
        result: ActionResult,
        dispatch: DispatchState | None = DispatchState.ACKNOWLEDGED,
        *,
        chunks: Sequence[StreamChunk] = (),
        lease_token: int | None = None,
    ) -> ActionRecord | None:
        """``correct_*``: replace ``record``'s provisional stored result
        (:func:`~.lifecycle.result_is_final` is false for it) with ``result``,
        what the sidecar's journal says (ARCHITECTURE.md §9 "Final results").
        Only while the stored result is still the one read (a concurrent
        correction wins). ``dispatch``: moved forward to this (None: kept).
        ``chunks``: the job's whole stream as re-normalized from the journal; the ones the store lacks
        are backfilled in the same fenced write as the result (:meth:`Store.update_action` ``chunks=``).
        ``lease_token``: the fencing token of a writer that corrects under the action's lease (None: a
        correction of an ended action, whose lease ended with it: the ``replacing`` condition guards it).
        Returns the corrected record, or None. Raises LeaseLost: ``lease_token`` is not current."""
        if record.result_json is None:
            raise ValueError("only a stored result can be corrected")
        event = CORRECTION_EVENTS[result.status]
        seal = self.sealer.seal(result)
        changed = await self.store.update_action(
            record.tenant,
            record.action_id,
            from_statuses=_sources(event),
            status=TRANSITIONS[event].target.value,
            dispatch=dispatch.value if dispatch is not None else None,
            result_json=_encode.encode(result).decode(),
            replacing=record.result_json,
            seal=seal,
            chunks=_rows(chunks),
            lease_token=lease_token,
        )
        if changed is not None:
            self.sealer.count(seal)
        log.info(
            "action_result_corrected",
            action_id=record.action_id,
            status=result.status,
            changed=changed is not None,
            backfilled=changed.chunk_count - record.chunk_count if changed is not None else 0,
        )
        return changed

    async def approve(self, record: ActionRecord) -> ActionRecord | None:
        """``approve``: a pending action starts, recorded ``sent`` (its dispatch follows at once)."""
        return await self.store.update_action(
            record.tenant,
            record.action_id,
            from_statuses=_sources(ActionEvent.APPROVE),
            status=TRANSITIONS[ActionEvent.APPROVE].target.value,
            dispatch=DispatchState.SENT.value,
        )

    async def decide(
        self, approver: Principal, approval_id: str, decision: str, reason: str, now: int, *, proof: str | None = None
    ) -> tuple[ApprovalRecord | None, ActionRecord | None]:
        """Record an approver's one decision (with the JSON ``proof`` of a signed
        one) and, when it admits the action (:func:`~.lifecycle.approval_admits`),
        apply ``approve`` in the same commit. Returns ``(decided approval or
        None, started action or None)``."""
        return await self.store.decide_and_start(
            approver.tenant, approval_id, decision, reason, approver.id, now, start_if=approval_admits, proof=proof
        )

    async def finish(
        self,
        tenant: str,
        action_id: str,
        result: ActionResult,
        dispatch: str | None,
        *,
        event: ActionEvent | None = None,
        operation: str | None = None,
        durable: bool = True,
        only_from: ActionState | None = None,
        settle_dispatch: bool = False,
        unstarted: bool = False,
        chunks: Sequence[StreamChunk] = (),
        lease_token: int | None = None,
    ) -> ActionRecord | None:
        """Store a final result: ``event`` (default: complete / fail / cancel
        by the result's status) from its table sources, or only from
        ``only_from``. ``settle_dispatch``: the dispatch's own final word. ``unstarted``: only while
        no start of it can be on its way to a sidecar (:meth:`Store.update_action`). ``chunks``: a result
        settled from the sidecar's journal carries its whole stream: the chunks the store lacks are
        appended in the same fenced write (as :meth:`correct`). ``lease_token``: the fencing token of
        the dispatch (or restart follower, or reconciliation under the lease) storing it: the result, its
        usage row and receipt are written only while it is current (:meth:`Store.update_action`); None:
        a writer that does not dispatch the action (a tenant's cancel, an approval's expiry).

        Returns the stored record, or None when the action was in no source
        state (another writer's result stands).

        Raises:
            LeaseLost: ``lease_token`` (else this host's own token) is not current: nothing was written."""
        event = event or RESULT_EVENTS[result.status]
        target = TRANSITIONS[event].target
        if target.value != result.status:
            raise ValueError(f"{event.value} stores {target.value}, not a {result.status} result")
        sources = [
            s.value
            for s in (ActionState.RUNNING, ActionState.PENDING_APPROVAL)
            if s in TRANSITIONS[event].sources and only_from in (None, s)
        ]
        seal = self.sealer.seal(result)
        changed = await self.store.update_action(
            tenant,
            action_id,
            from_statuses=sources,
            status=target.value,
            dispatch=dispatch,
            result_json=_encode.encode(result).decode(),
            durable=durable,
            settle_dispatch=settle_dispatch,
            seal=seal,
            unstarted=unstarted,
            chunks=_rows(chunks),
            lease_token=lease_token,
        )
        log.info("action_finished", status=result.status, changed=changed is not None)
        if changed:
            self._count(operation or changed.operation, result)
            self.sealer.count(seal)
        return changed

    async def withdraw(self, tenant: str, action_id: str, result: ActionResult) -> ActionRecord | None:
        """``withdraw``: a pending action is cancelled and its approval withdrawn in one commit."""
        if result.status != TRANSITIONS[ActionEvent.WITHDRAW].target.value:
            raise ValueError("a withdrawn action is cancelled")
        seal = self.sealer.seal(result)
        changed = await self.store.cancel_pending(tenant, action_id, _encode.encode(result).decode(), seal=seal)
        if changed and self.metrics is not None:
            self.metrics.actions.inc(operation=changed.operation, status=result.status)
        return changed

    async def expire_due(self, now: int) -> list[ActionRecord]:
        """``expire``: every pending approval past its TTL is expired and its
        pending action fails with ``policy.approval_expired`` (all tenants).
        Returns the actions it failed."""
        failed = []
        for approval in await self.store.expire_approvals(now):
            record = await self.expire(approval.tenant, approval.action_id)
            if record is not None:
                failed.append(record)
        return failed

    async def expire(self, tenant: str, action_id: str) -> ActionRecord | None:
        """``expire`` one pending action whose approval ran out."""
        return await self.finish(
            tenant,
            action_id,
            failed_result(action_id, ApprovalExpired()),
            DispatchState.NOT_SENT.value,
            event=ActionEvent.EXPIRE,
        )


class ActionRuntime(Protocol):
    """What the lifecycle functions (:mod:`.cancellation`, :mod:`.recovery`, :mod:`.dispatch_task`)
    use of the action service: the writer, the dispatcher, the live registry,
    and reads."""

    store: Store
    writer: ActionWriter
    dispatcher: Dispatcher
    live: LiveRegistry
    now_ms: Callable[[], int]
    #: How long a start the sidecar provably did not admit is retried, ms (ARCHITECTURE.md §9).
    dispatch_deadline_ms: int

    async def get(self, caller: Principal, action_id: str) -> ActionRecord: ...
    async def record(self, tenant: str, action_id: str) -> ActionRecord: ...
    async def result(self, record: ActionRecord) -> ActionResult | None: ...
    async def refresh(self, record: ActionRecord) -> ActionRecord: ...
    def job(self, record: ActionRecord, *, stream: bool) -> Job: ...
    def start(self, record: ActionRecord, *, stream: bool = False) -> LiveAction: ...
    def revocation(self, record: ActionRecord) -> CapabilityRevoked | None: ...
