"""The host store's approvals: pending approvals, the one decision (with its action's start in the same
transaction), withdrawal, expiry, and the approval event log (migration 4).

:class:`ApprovalMethods` is a part of :class:`~aip_crewai.host.store.store.Store` (its base class), split
out by concept: it uses the store's worker-thread primitives (``_run``, ``_fetch_now``,
``_transaction_now``, ...) exactly as the rest of the store does, and every method keeps the store's
rules (tenant first, one decision per statement or transaction). Every write here wakes the approval
event stream (``approvals_changed``), also when it fails.

Source: ARCHITECTURE.md §7 (approvals, "every store key starts with the tenant"); docs/approvals.md "Approval events".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ...plumbing.wakeup import ChangeSignal
from ..actions.lifecycle import ActionState
from .engines.engine import Db
from .engines.postgres import DB_NOW
from .records import (
    APPROVAL_DECISIONS,
    ActionRecord,
    ApprovalEvent,
    ApprovalPage,
    ApprovalRecord,
    Seal,
    StoreError,
    decode_cursor,
    encode_cursor,
)
from .sql import ACTION_COLUMNS, APPROVAL_COLUMNS, GET_ACTION, action_update

_T = TypeVar("_T")
_S = ActionState
#: The one decision: only from ``pending``, before ``expires_at``, never by the requester.
# A decision needs the approval pending and unexpired, a decider other than the requester, AND its action
# still waiting for it (a cancel that won leaves nothing to decide): all in one WHERE.
_DECIDE = (
    "UPDATE approvals SET status = ?, decision_reason = ?, decided_by = ?, decided_at = ?, decision_proof = ? "
    "WHERE tenant = ? AND approval_id = ? AND status = 'pending' AND expires_at > ? AND requested_by != ? "
    "AND EXISTS (SELECT 1 FROM actions WHERE actions.tenant = approvals.tenant "
    "AND actions.action_id = approvals.action_id AND actions.status = 'pending_approval')"
)


class ApprovalMethods:
    """The approval half of :class:`~aip_crewai.host.store.store.Store` (its base class; never used alone)."""

    if TYPE_CHECKING:  # provided by Store
        _db: Db
        owner: str | None
        approvals_changed: ChangeSignal

        def now_ms(self) -> int: ...
        async def _run(self, fn: Callable[..., _T], *args: Any) -> _T: ...
        async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
        def _fetch_now(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
        def _transaction_now(self, fn: Callable[[], _T]) -> _T: ...
        def _update_now(
            self, update: tuple[str, tuple[Any, ...]], seal: Seal | None = None, *, fenced: int | None = None
        ) -> ActionRecord | None: ...
        def _lease_for(self, status: str) -> tuple[str | None, int | None, int]: ...
        def _hold(self, record: ActionRecord) -> None: ...
        def _outbox_approval_now(self, tenant: str, approval_id: str) -> None: ...
        def _with_outbox(self, seal: Seal | None) -> Seal | None: ...

    def _log_approval_now(self, tenant: str, approval_id: str, status: str) -> None:
        """Append ``(approval_id, status)`` to ``tenant``'s approval event log at the next position
        (inside the caller's transaction, which excludes every other writer)."""
        self._db.change(
            "INSERT INTO approval_events (tenant, seq, approval_id, status) SELECT CAST(? AS TEXT), "
            "COALESCE(MAX(seq), 0) + 1, CAST(? AS TEXT), CAST(? AS TEXT) FROM approval_events "
            "WHERE tenant = ?",
            (tenant, approval_id, status, tenant),
        )
        self._outbox_approval_now(tenant, approval_id)  # its webhook events, in the same transaction

    def _insert_approval_now(self, request: tuple[str, ...], now: int, expires_at: int) -> ApprovalRecord:
        """Insert a pending approval and log it (inside the caller's transaction, on the worker). ``request``:
        ``(tenant, approval_id, action_id, capability_id, policy_hash, requested_by, input_snapshot_json)``."""
        rows = self._fetch_now(
            f"INSERT INTO approvals ({APPROVAL_COLUMNS}) VALUES ({', '.join('?' * 14)}) RETURNING {APPROVAL_COLUMNS}",
            (*request, "pending", None, None, None, now, expires_at, None),
        )
        self._log_approval_now(request[0], request[1], "pending")
        return ApprovalRecord(*rows[0])

    async def _approvals_write(self, fn: Callable[..., _T], *args: Any) -> _T:
        """:meth:`_run` a write that may change approvals, then wake the approval stream (also on failure)."""
        try:
            return await self._run(fn, *args)
        finally:
            self.approvals_changed.notify()

    # --- approvals (ARCHITECTURE.md §7) ---

    async def create_approval(
        self,
        tenant: str,
        approval_id: str,
        action_id: str,
        capability_id: str,
        policy_hash: str,
        requested_by: str,
        input_snapshot_json: str,
        expires_at: int,
        *,
        now: int | None = None,
    ) -> ApprovalRecord:
        """Insert a pending approval for an existing action (whose row already
        names ``approval_id``: see ``ActionService.submit``).

        Raises:
            StoreError: the approval id exists, or the action does not.
        """
        now = self.now_ms() if now is None else now
        args = (tenant, approval_id, action_id, capability_id, policy_hash, requested_by, input_snapshot_json)

        def create() -> ApprovalRecord:
            try:
                return self._transaction_now(lambda: self._insert_approval_now(args, now, expires_at))
            except self._db.integrity_error as exc:
                raise StoreError(f"approval {approval_id!r} exists or action {action_id!r} does not") from exc

        return await self._approvals_write(create)

    async def get_approval(self, tenant: str, approval_id: str) -> ApprovalRecord | None:
        rows = await self._fetch(
            f"SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant = ? AND approval_id = ?", (tenant, approval_id)
        )
        return ApprovalRecord(*rows[0]) if rows else None

    async def get_approval_and_action(
        self, tenant: str, approval_id: str
    ) -> tuple[ApprovalRecord | None, ActionRecord | None]:
        """The approval ``approval_id`` of ``tenant`` and its action, in one hop to the store's worker instead
        of two (a decision reads both before its transaction); ``(None, None)`` when there is no such approval."""

        def read() -> tuple[ApprovalRecord | None, ActionRecord | None]:
            rows = self._fetch_now(
                f"SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant = ? AND approval_id = ?", (tenant, approval_id)
            )
            if not rows:
                return None, None
            approval = ApprovalRecord(*rows[0])
            actions = self._fetch_now(GET_ACTION, (tenant, approval.action_id))
            return approval, ActionRecord(*actions[0]) if actions else None

        return await self._run(read)

    async def list_approvals(
        self,
        tenant: str,
        status: str | tuple[str, ...] | None = None,
        cursor: str | None = None,
        limit: int = 100,
        *,
        newest_first: bool = False,
    ) -> ApprovalPage:
        """One page of a tenant's approvals, oldest first (``newest_first``: newest first), by stored
        status: one (``status="pending"`` for the queue), any of a tuple, or None for all.

        Args:
            cursor: ``next_cursor`` of the previous page in the same order (opaque), or None.
            limit: 1..200.

        Raises:
            ValueError: ``limit`` out of range. InvalidCursor: a malformed cursor.
        """
        if not 1 <= limit <= 200:
            raise ValueError("limit must be 1..200")
        clauses: list[str] = ["tenant = ?"]
        params: list[Any] = [tenant]
        statuses = (status,) if isinstance(status, str) else status
        if statuses is not None:
            clauses.append(f"status IN ({', '.join('?' for _ in statuses)})")
            params += list(statuses)
        if cursor is not None:
            created_at, approval_id = decode_cursor(cursor)
            clauses.append(f"(created_at, approval_id) {'<' if newest_first else '>'} (?, ?)")
            params += [created_at, approval_id]
        order = "created_at DESC, approval_id DESC" if newest_first else "created_at, approval_id"
        rows = await self._fetch(
            f"SELECT {APPROVAL_COLUMNS} FROM approvals WHERE {' AND '.join(clauses)} ORDER BY {order} LIMIT ?",
            (*params, limit + 1),
        )
        items = [ApprovalRecord(*row) for row in rows[:limit]]
        done = len(rows) <= limit
        next_cursor = None if done else encode_cursor(items[-1].created_at, items[-1].approval_id)
        return ApprovalPage(items, next_cursor, done)

    async def decide_and_start(
        self,
        tenant: str,
        approval_id: str,
        decision: str,
        reason: str,
        decided_by: str,
        now: int,
        *,
        start_if: Callable[[ApprovalRecord, ActionRecord], bool],
        proof: str | None = None,
    ) -> tuple[ApprovalRecord | None, ActionRecord | None]:
        """Record the one decision exactly as :meth:`decide_approval` does and,
        in the SAME transaction (one commit), move its action from
        ``pending_approval`` to ``running`` with dispatch ``sent`` when the
        decision is ``approved`` and ``start_if(approval, action)`` holds (a
        pure check, run on the worker: the approval's binding and expiry).

        Returns:
            ``(approval, started)``: the decided approval (None when this call
            did not decide it: already decided, expired, the requester, or
            unknown) and the started action (None when it was not started).
            ``proof`` (the JSON proof of a signed decision) is stored with the decision.

        Raises:
            ValueError: ``decision`` is not approved/denied.
        """
        if decision not in APPROVAL_DECISIONS:
            raise ValueError(f"decision must be one of {APPROVAL_DECISIONS}")

        def decide() -> tuple[ApprovalRecord | None, ActionRecord | None]:
            rows = self._fetch_now(
                f"{_DECIDE} RETURNING {APPROVAL_COLUMNS}",
                (decision, reason, decided_by, now, proof, tenant, approval_id, now, decided_by),
            )
            if not rows:
                return None, None
            approval = ApprovalRecord(*rows[0])
            self._log_approval_now(tenant, approval_id, approval.status)
            found = self._fetch_now(GET_ACTION, (tenant, approval.action_id))
            action = ActionRecord(*found[0]) if found else None
            if (
                approval.status != "approved"
                or action is None
                or action.status != _S.PENDING_APPROVAL.value
                or not start_if(approval, action)
            ):
                return approval, None
            started = self._update_now(
                action_update(
                    tenant,
                    action.action_id,
                    from_statuses=[_S.PENDING_APPROVAL.value],
                    status=_S.RUNNING.value,
                    dispatch="sent",
                    now=now,
                )
            )
            if started is not None and self.owner is not None:  # the deciding host dispatches: its lease
                owner, lease_ms, _ = self._lease_for(_S.RUNNING.value)
                leased = self._fetch_now(  # the database's clock; a new holder: the next fencing token
                    f"UPDATE actions SET lease_owner = ?, lease_expires_at = {DB_NOW} + ?, "
                    "lease_epoch = lease_epoch + 1 WHERE tenant = ? AND action_id = ? "
                    f"RETURNING {ACTION_COLUMNS}",
                    (owner, lease_ms, tenant, action.action_id),
                )
                started = ActionRecord(*leased[0]) if leased else started
            return approval, started

        approval, started = await self._approvals_write(self._transaction_now, decide)
        if started is not None:
            self._hold(started)
        return approval, started

    async def cancel_pending(
        self, tenant: str, action_id: str, result_json: str, *, seal: Seal | None = None
    ) -> ActionRecord | None:
        """In ONE transaction: move a ``pending_approval`` action to
        ``cancelled`` with ``result_json``, and withdraw its pending approval
        (status ``withdrawn``: no decision can be recorded any more).

        Returns the cancelled record, or None when the action was no longer
        pending (an approval started it first: that row stands, nothing changed).
        ``seal``: what the result leaves, in the same transaction (:func:`.ledger.seal_now`).
        """
        now = self.now_ms()
        seal = self._with_outbox(seal)

        def cancel() -> ActionRecord | None:
            record = self._update_now(
                action_update(
                    tenant,
                    action_id,
                    from_statuses=[_S.PENDING_APPROVAL.value],
                    status=_S.CANCELLED.value,
                    result_json=result_json,
                    now=now,
                ),
                seal,
            )
            if record is not None:
                for (withdrawn,) in self._fetch_now(
                    "UPDATE approvals SET status = 'withdrawn' WHERE tenant = ? "
                    "AND action_id = ? AND status = 'pending' RETURNING approval_id",
                    (tenant, action_id),
                ):
                    self._log_approval_now(tenant, withdrawn, "withdrawn")
            return record

        return await self._approvals_write(self._transaction_now, cancel)

    async def expire_approvals(self, now: int) -> list[ApprovalRecord]:
        """Mark every pending approval with ``expires_at <= now`` expired (all
        tenants); returns the records it changed (so their actions can fail)."""

        def expire() -> list[ApprovalRecord]:
            expired = [
                ApprovalRecord(*row)
                for row in self._fetch_now(
                    "UPDATE approvals SET status = 'expired' WHERE status = 'pending' AND expires_at <= ? "
                    f"RETURNING {APPROVAL_COLUMNS}",
                    (now,),
                )
            ]
            for approval in sorted(expired, key=lambda a: (a.tenant, a.expires_at, a.approval_id)):
                self._log_approval_now(approval.tenant, approval.approval_id, "expired")
            return expired

        return await self._approvals_write(self._transaction_now, expire)

    # --- the approval event log (migration 4; docs/approvals.md "Approval events") ---

    async def list_approval_events(self, tenant: str, after_seq: int, limit: int) -> list[ApprovalEvent]:
        """A tenant's approval events with ``seq > after_seq``, oldest first, at most ``limit``."""
        rows = await self._fetch(
            "SELECT seq, approval_id, status FROM approval_events WHERE tenant = ? AND seq > ? ORDER BY seq LIMIT ?",
            (tenant, after_seq, limit),
        )
        return [ApprovalEvent(*row) for row in rows]

    async def last_approval_event(self, tenant: str) -> int:
        """The position of a tenant's latest approval event (0: none yet)."""
        rows = await self._fetch("SELECT COALESCE(MAX(seq), 0) FROM approval_events WHERE tenant = ?", (tenant,))
        return int(rows[0][0])
