"""The webhook outbox (docs/webhooks.md): events written in the transaction of the state change they
report, claimed by one host at a time, attempted, and released or finished. Functions over
:class:`.engines.engine.Db` and the :class:`OutboxMethods` of :class:`~aip_crewai.host.store.store.Store`
(one of its base classes), as :mod:`.ledger` is written.

Writing: the store's hook ``outbox_events`` (:class:`.records.OutboxEvents`) is asked for rows inside every
transaction that logs an approval's status (:meth:`OutboxMethods._outbox_approval_now`, from the approval
event log's one writer) and every one that stores a result (the result's seal, :meth:`OutboxMethods._with_outbox`),
so no state change can commit without its events, nor an event without its change. ``seq`` numbers one
endpoint's events of one action from 1.

Claiming: one write transaction (the writer lock) first expires pending rows past their deadline, then
claims up to ``limit`` due rows for ``host_id`` until the database's clock (:data:`.engines.postgres.DB_NOW`)
passes ``claim_expires_at``; a row is due when its ``next_attempt_at`` has come, no live claim holds it, and
no earlier event of the same (tenant, endpoint, action) is still pending: events of one action go out in
order. A host that dies holding claims loses them when they expire; another host takes the rows then. A host
process starting under a ``host_id`` takes that id's claims back at once (:meth:`OutboxMethods.release_claims`):
the process that held them is gone (a crash, a stop: its attempts were cancelled), or frozen, and then a
repeated delivery carries the same ``webhook-id``, which receivers deduplicate.

Source: ARCHITECTURE.md §10 (storage, leases on the database's clock); docs/webhooks.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .engines.engine import Db
from .engines.postgres import DB_NOW
from .records import (
    ActionRecord,
    ApprovalRecord,
    ClaimedDelivery,
    DeliveryAttempt,
    DeliveryRecord,
    OutboxEvents,
    OutboxRow,
    Seal,
    SealedRows,
    decode_cursor,
    encode_cursor,
)
from .sql import APPROVAL_COLUMNS

_T = TypeVar("_T")

#: Delivery statuses.
PENDING, DELIVERED, EXPIRED = "pending", "delivered", "expired"
#: The attempts listed with each delivery, newest kept.
LISTED_ATTEMPTS = 20

_ENQUEUE = (
    "INSERT INTO webhook_deliveries (tenant, delivery_id, endpoint_id, event_type, action_id, seq, body, status, "
    "attempts, created_at, deadline_at, next_attempt_at) SELECT CAST(? AS TEXT), CAST(? AS TEXT), CAST(? AS TEXT), "
    "CAST(? AS TEXT), CAST(? AS TEXT), COALESCE(MAX(seq), 0) + 1, CAST(? AS TEXT), 'pending', 0, ?, ?, ? "
    "FROM webhook_deliveries WHERE tenant = ? AND endpoint_id = ? AND action_id = ?"
)
_EXPIRE_PAST_DEADLINE = (
    "UPDATE webhook_deliveries SET status = 'expired', finished_at = " + DB_NOW + ", last_outcome = 'deadline', "
    "claimed_by = NULL, claim_expires_at = NULL WHERE status = 'pending' AND deadline_at <= " + DB_NOW + " "
    "AND (claimed_by IS NULL OR claim_expires_at <= " + DB_NOW + ")"
)
_CLAIM = (
    "UPDATE webhook_deliveries SET claimed_by = ?, claim_expires_at = " + DB_NOW + " + ? "
    "WHERE status = 'pending' AND (tenant, delivery_id) IN (SELECT d.tenant, d.delivery_id FROM webhook_deliveries d "
    "WHERE d.status = 'pending' AND d.next_attempt_at <= " + DB_NOW + " "
    "AND (d.claimed_by IS NULL OR d.claim_expires_at <= " + DB_NOW + ") "
    "AND NOT EXISTS (SELECT 1 FROM webhook_deliveries e WHERE e.tenant = d.tenant AND e.endpoint_id = d.endpoint_id "
    "AND e.action_id = d.action_id AND e.status = 'pending' AND e.seq < d.seq) "
    "ORDER BY d.next_attempt_at, d.created_at LIMIT ?) "
    "RETURNING tenant, delivery_id, endpoint_id, event_type, action_id, body, attempts, created_at, deadline_at"
)
#: A starting host's claims of its own ``host_id`` (a previous process's): due again at once.
_RELEASE_OWN = (
    "UPDATE webhook_deliveries SET claimed_by = NULL, claim_expires_at = NULL WHERE status = 'pending' "
    "AND claimed_by = ?"
)
#: One attempt's end: ``status`` is DELIVERED, EXPIRED, or PENDING (retry after ``delay`` ms, unless that is
#: past the deadline: then EXPIRED). Only while ``host_id`` still holds the claim.
_FINISH = (
    "UPDATE webhook_deliveries SET attempts = attempts + 1, last_outcome = ?, claimed_by = NULL, "
    "claim_expires_at = NULL, "
    "status = CASE WHEN CAST(? AS TEXT) = 'pending' AND " + DB_NOW + " + ? >= deadline_at THEN 'expired' "
    "ELSE CAST(? AS TEXT) END, "
    "next_attempt_at = " + DB_NOW + " + ?, "
    "finished_at = CASE WHEN CAST(? AS TEXT) = 'pending' AND " + DB_NOW + " + ? < deadline_at THEN NULL "
    "ELSE " + DB_NOW + " END "
    "WHERE tenant = ? AND delivery_id = ? AND status = 'pending' AND claimed_by = ? RETURNING status, attempts"
)
_RECORD_ATTEMPT = (
    "INSERT INTO webhook_attempts (tenant, delivery_id, attempt, host_id, started_at, duration_ms, outcome, "
    "status_code) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_DELIVERY_COLUMNS = (
    "tenant, delivery_id, endpoint_id, event_type, action_id, status, attempts, created_at, deadline_at, "
    "next_attempt_at, finished_at, last_outcome"
)


def enqueue_now(db: Db, rows: Sequence[OutboxRow]) -> None:
    """Write ``rows`` to the outbox (on the worker, inside the caller's transaction), each due at once."""
    for row in rows:
        db.change(
            _ENQUEUE,
            (
                row.tenant,
                row.delivery_id,
                row.endpoint_id,
                row.event_type,
                row.action_id,
                row.body,
                row.created_at,
                row.deadline_at,
                row.created_at,
                row.tenant,
                row.endpoint_id,
                row.action_id,
            ),
        )


def delivery_cursor(record: DeliveryRecord) -> str:
    """The opaque cursor after ``record`` in :meth:`OutboxMethods.list_deliveries`' order (newest first)."""
    return encode_cursor(record.created_at, record.delivery_id)


class OutboxMethods:
    """The outbox methods of :class:`~aip_crewai.host.store.store.Store` (a base class, never used alone)."""

    #: The hook asked for each state change's events (None: no webhooks configured).
    outbox_events: OutboxEvents | None = None

    if TYPE_CHECKING:  # provided by Store
        _db: Db

        async def _run(self, fn: Callable[..., _T], *args: Any) -> _T: ...
        async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
        def _write_now(self, durable: bool, fn: Callable[[], _T]) -> _T: ...
        def _transaction_now(self, fn: Callable[[], _T]) -> _T: ...

    def _outbox_approval_now(self, tenant: str, approval_id: str) -> None:
        """Inside an approval status change's transaction: write the events the hook gives for it."""
        events = self.outbox_events
        if events is None:
            return
        rows = self._db.fetch(
            f"SELECT {APPROVAL_COLUMNS} FROM approvals WHERE tenant = ? AND approval_id = ?", (tenant, approval_id)
        )
        if rows:
            enqueue_now(self._db, events.for_approval(ApprovalRecord(*rows[0])))

    def _with_outbox(self, seal: Seal | None) -> Seal | None:
        """``seal`` extended with the events of the result it seals (written with it: :func:`.ledger.seal_now`)."""
        events = self.outbox_events
        if events is None or seal is None:
            return seal
        inner = seal

        def sealed(record: ActionRecord, proof: str | None) -> SealedRows | None:
            rows = inner(record, proof)
            written = record if rows is None else dataclasses.replace(record, result_json=rows.result_json)
            found = tuple(events.for_result(written))
            if not found or written.result_json is None:
                return rows
            return dataclasses.replace(rows or SealedRows(written.result_json), outbox=found)

        return sealed

    async def claim_deliveries(self, host_id: str, claim_ms: int, limit: int) -> list[ClaimedDelivery]:
        """Expire pending deliveries past their deadline, then claim up to ``limit`` due ones for ``host_id``
        for ``claim_ms`` (the module docstring's rules; one transaction under the writer lock)."""

        def claim() -> list[ClaimedDelivery]:
            self._db.change(_EXPIRE_PAST_DEADLINE)
            return [ClaimedDelivery(*row) for row in self._db.fetch(_CLAIM, (host_id, claim_ms, limit))]

        return await self._run(self._write_now, True, lambda: self._transaction_now(claim))

    async def release_claims(self, host_id: str) -> int:
        """Release the pending deliveries claimed by ``host_id`` (a previous process of this host's; called once
        as its webhook sender starts), so they are due at once instead of when the claims expire (the longest
        ``timeout_seconds`` + 30 s). Returns how many were released (module docstring, "Claiming")."""
        return await self._run(
            self._write_now, True, lambda: self._transaction_now(lambda: self._db.change(_RELEASE_OWN, (host_id,)))
        )

    async def finish_attempt(
        self,
        claimed: ClaimedDelivery,
        host_id: str,
        *,
        status: str,
        outcome: str,
        status_code: int | None,
        started_at: int,
        duration_ms: int,
        retry_in_ms: int = 0,
    ) -> str | None:
        """Record one attempt of ``claimed`` and release the claim: ``status`` DELIVERED, EXPIRED, or PENDING
        (due again in ``retry_in_ms``; EXPIRED instead when that reaches the deadline). Only while
        ``host_id`` still holds the claim: returns the row's new status, or None (the claim was lost to
        another host after it expired; nothing written)."""

        def finish() -> str | None:
            rows = self._db.fetch(
                _FINISH,
                (
                    outcome,
                    status,
                    retry_in_ms,
                    status,
                    retry_in_ms,
                    status,
                    retry_in_ms,
                    claimed.tenant,
                    claimed.delivery_id,
                    host_id,
                ),
            )
            if not rows:
                return None
            new_status, attempts = rows[0]
            self._db.change(
                _RECORD_ATTEMPT,
                (
                    claimed.tenant,
                    claimed.delivery_id,
                    int(attempts),
                    host_id,
                    started_at,
                    duration_ms,
                    outcome,
                    status_code,
                ),
            )
            return str(new_status)

        return await self._run(self._write_now, True, lambda: self._transaction_now(finish))

    async def list_deliveries(
        self,
        tenant: str,
        *,
        status: str | None = None,
        event_type: str | None = None,
        action_id: str | None = None,
        endpoint_id: str | None = None,
        limit: int = 50,
        before: str | None = None,
    ) -> list[DeliveryRecord]:
        """``tenant``'s deliveries, newest first, at most ``limit``, filtered by ``status``, ``event_type``,
        ``action_id`` and ``endpoint_id``; ``before``: the :func:`delivery_cursor` of the last one of the
        previous page (opaque), only older ones. Each with its latest :data:`LISTED_ATTEMPTS` attempts,
        oldest first.

        Raises:
            InvalidCursor: ``before`` is not a cursor.
        """
        where: list[str] = ["tenant = ?"]
        params: list[Any] = [tenant]
        filters = (
            ("status", status),
            ("event_type", event_type),
            ("action_id", action_id),
            ("endpoint_id", endpoint_id),
        )
        for column, value in filters:
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if before is not None:
            created, delivery_id = decode_cursor(before)
            where.append("(created_at < ? OR (created_at = ? AND delivery_id < ?))")
            params.extend([created, created, delivery_id])

        def read() -> list[DeliveryRecord]:
            records = []
            sql = (
                f"SELECT {_DELIVERY_COLUMNS} FROM webhook_deliveries WHERE {' AND '.join(where)} "
                "ORDER BY created_at DESC, delivery_id DESC LIMIT ?"
            )
            for row in self._db.fetch(sql, (*params, limit)):
                attempts = self._db.fetch(
                    "SELECT attempt, host_id, started_at, duration_ms, outcome, status_code FROM webhook_attempts "
                    "WHERE tenant = ? AND delivery_id = ? ORDER BY attempt DESC LIMIT ?",
                    (row[0], row[1], LISTED_ATTEMPTS),
                )
                history = tuple(DeliveryAttempt(*a) for a in reversed(attempts))
                records.append(dataclasses.replace(DeliveryRecord(*row), history=history))
            return records

        return await self._run(read)

    async def pending_deliveries(self) -> int:
        """How many deliveries are still pending (all tenants)."""
        rows = await self._fetch("SELECT COUNT(*) FROM webhook_deliveries WHERE status = 'pending'")
        return int(rows[0][0])
