"""The host store's dispatch leases and their fencing tokens (ARCHITECTURE.md §10, dispatch leases).

:class:`LeaseMethods` is a part of :class:`~aip_crewai.host.store.store.Store` (one of its base classes),
split out by concept as :mod:`.approvals` is. A running action on a shared store is dispatched or
reconciled by the one host holding its lease (``lease_owner`` until ``lease_expires_at``, ms). Expiry
is judged, and a new expiry computed, with the database's clock (:data:`.engines.postgres.DB_NOW`: PostgreSQL's
``now()``; a SQLite store's own clock, one host), never a host's. Each time another host takes the lease,
its fencing token ``lease_epoch`` goes up. Every write of a dispatch (and of a restart follower, and of
a reconciliation under the lease) carries the token it took with the lease (``lease_token=``: chunks and
their count, results with their usage and receipt, dispatch state, requeues, corrections:
``Store.append_chunks``, ``Store.update_action``) and is conditional on that token being current, in the
same statement or transaction, even after this host forgot it; a write without one is fenced by the
token this host holds on the action, if any, else guarded by the status conditions alone (a host that
never held the lease: a cancel, a read's correction). A write refused for the token raises
:class:`~.records.LeaseLost`, writes nothing, and forgets the token.

Source: ARCHITECTURE.md §10 (dispatch leases).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from ..actions.lifecycle import ActionState
from .engines.postgres import DB_NOW
from .records import ActionRecord, LeaseLost
from .sql import ACTION_COLUMNS

_T = TypeVar("_T")
_S = ActionState
log = structlog.get_logger(__name__)


class LeaseMethods:
    """The lease half of :class:`~aip_crewai.host.store.store.Store` (a base class; never used alone)."""

    if TYPE_CHECKING:  # provided by Store
        owner: str | None
        lease_ms: int

        @property
        def engine(self) -> str: ...

        def now_ms(self) -> int: ...
        async def _run(self, fn: Callable[..., _T], *args: Any) -> _T: ...
        def _fetch_now(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
        def _write_now(self, durable: bool, fn: Callable[[], _T]) -> _T: ...

    def _init_leases(self) -> None:
        #: This host's fencing tokens: (tenant, action id) → (lease_epoch, order taken).
        self._tokens: dict[tuple[str, str], tuple[int, int]] = {}
        self._tokens_taken = 0
        self._lost: set[tuple[str, str]] = set()

    def _lease_for(self, status: str) -> tuple[str | None, int | None, int]:
        """``(lease_owner, lease length ms, lease_epoch)`` of a new row entering ``status``: this host's
        first lease when running (its expiry is computed with the database's clock)."""
        if self.owner is None or status != _S.RUNNING.value:
            return None, None, 0
        return self.owner, self.lease_ms, 1

    def _hold(self, record: ActionRecord) -> None:
        """Remember ``record``'s fencing token when this host holds its lease (as just written)."""
        if self.owner is not None and record.lease_owner == self.owner and record.status == _S.RUNNING:
            self._tokens_taken += 1
            self._tokens[(record.tenant, record.action_id)] = (record.lease_epoch, self._tokens_taken)

    def lease_token(self, tenant: str, action_id: str) -> int | None:
        """The fencing token (epoch) of this host's lease on the action, or None (no lease held here)."""
        held = self._tokens.get((tenant, action_id))
        return held[0] if held is not None else None

    def _fenced(self, tenant: str, action_id: str, token: int | None = None) -> tuple[str, tuple[Any, ...]]:
        """The SQL condition (and its parameters) that makes a write on behalf of the action apply only
        while this host's fencing token is current: ``token`` when the writer kept the one it works under
        (a dispatch's chunk writer: its token stays its fence after this host forgot it), else the token
        this host holds; empty when there is neither (a host that never leased the action writes as
        before: the status conditions guard it), or without leases (no host id: no owner)."""
        token = self.lease_token(tenant, action_id) if token is None else token
        if token is None or self.owner is None:
            return "", ()
        return " AND lease_owner = ? AND lease_epoch = ?", (self.owner, token)

    def _check_fence_now(self, tenant: str, action_id: str, token: int | None = None) -> None:
        """After a fenced write changed nothing (on the worker, in its transaction): raise LeaseLost when
        the reason is the token (``token``, else the one this host holds: another host holds the lease
        now), forgetting this host's token."""
        token = self.lease_token(tenant, action_id) if token is None else token
        if token is None or self.owner is None:
            return
        rows = self._fetch_now(
            "SELECT lease_owner, lease_epoch FROM actions WHERE tenant = ? AND action_id = ?", (tenant, action_id)
        )
        if rows and (rows[0][0], rows[0][1]) != (self.owner, token):
            if self.lease_token(tenant, action_id) == token:  # not a newer lease this host took since
                self._tokens.pop((tenant, action_id), None)
            log.warning(
                "lease_lost", tenant=tenant, action_id=action_id, epoch=token, holder=rows[0][0], current=rows[0][1]
            )
            raise LeaseLost()

    def lease_is_foreign(self, record: ActionRecord, *, now: int | None = None) -> bool:
        """Whether ``record`` (as read) shows another host's live lease: :meth:`take_lease` would fail, so a
        reader following that host's action skips the write (pure, judged by this host's clock: a hint
        only; the write, on the database's clock, stays the authority)."""
        if self.owner is None or record.lease_owner in (None, self.owner) or record.lease_expires_at is None:
            return False
        return record.lease_expires_at > (self.now_ms() if now is None else now)

    async def take_lease(self, tenant: str, action_id: str) -> bool:
        """Take (or keep) the dispatch lease of a running action for this host: True when this host now
        holds it; False when another host's lease is live (it dispatches or reconciles the action) or the
        action no longer runs. Without an owner (no lease mode): True. One statement, so two hosts
        racing for an expired lease cannot both win. Expiry is judged, and the new one computed, with the
        database's clock (a host whose clock is off cannot take a live lease). Taking the lease from
        another host (or from none, or from another process under this host's id: only the process holding
        the current token keeps it) raises its fencing token (``lease_epoch``); this host's later writes
        on behalf of the action are conditional on it (ARCHITECTURE.md §10)."""
        if self.owner is None:
            return True
        # The token stays only for the process that holds it: another process under the same host id (a
        # replacement started while this one was frozen, its id lock lost to a database restart) takes the
        # lease with a new token, so the old process's writes are refused at once (docs/operating.md).
        held = self.lease_token(tenant, action_id)
        held = -1 if held is None else held
        rows = await self._run(
            self._write_now,
            True,
            lambda: self._fetch_now(
                f"UPDATE actions SET lease_expires_at = {DB_NOW} + ?, lease_epoch = CASE WHEN lease_owner = ? "
                "AND lease_epoch = ? THEN lease_epoch ELSE lease_epoch + 1 END, lease_owner = ? WHERE tenant = ? "
                f"AND action_id = ? AND status = 'running' AND (lease_owner IS NULL OR lease_owner = ? OR "
                f"lease_expires_at <= {DB_NOW}) RETURNING {ACTION_COLUMNS}",
                (self.lease_ms, self.owner, held, self.owner, tenant, action_id, self.owner),
            ),
        )
        if not rows:
            self._tokens.pop((tenant, action_id), None)
            return False
        self._hold(ActionRecord(*rows[0]))
        return True

    async def renew_leases(self) -> int:
        """Extend every lease this host holds on a running action by :attr:`lease_ms` (the database's
        clock); returns how many. Forgets the tokens of actions no longer leased here (finished, or taken
        by another host: :meth:`lost_leases` says which of those this host still follows).

        On PostgreSQL a row locked by a session outside the store (an operator's open transaction) is
        skipped, not waited for: its lease stays this host's until it expires, and the host's other leases
        are renewed (docs/operating.md "Faults and their bounds")."""
        if self.owner is None:
            return 0
        before = self._tokens_taken
        mine = "lease_owner = ? AND status = 'running'"
        skip_locked = " FOR UPDATE SKIP LOCKED" if self.engine == "postgresql" else ""

        def renew() -> tuple[int, list[tuple[Any, ...]]]:
            renewed = self._fetch_now(
                f"UPDATE actions SET lease_expires_at = {DB_NOW} + ? WHERE {mine} AND (tenant, action_id) IN "
                f"(SELECT tenant, action_id FROM actions WHERE {mine}{skip_locked}) RETURNING action_id",
                (self.lease_ms, self.owner, self.owner),
            )
            return len(renewed), self._fetch_now(
                f"SELECT tenant, action_id, lease_epoch FROM actions WHERE {mine}", (self.owner,)
            )

        count, rows = await self._run(self._write_now, True, renew)
        held = {(tenant, action_id): epoch for tenant, action_id, epoch in rows}
        for key, (epoch, taken) in list(self._tokens.items()):
            if taken <= before and held.get(key) != epoch:
                self._tokens.pop(key, None)
                self._lost.add(key)
        return int(count)

    def lost_leases(self) -> set[tuple[str, str]]:
        """The ``(tenant, action_id)`` whose tokens the last renewals dropped (cleared by this call): the
        caller stops following those actions (those that ended need nothing)."""
        lost, self._lost = self._lost, set()
        return lost
