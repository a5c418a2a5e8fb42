"""An action's creation: its starting state, and its row inserted with its idempotency key's
reservation in one transaction (functions over :class:`.engines.engine.Db`, run on a store worker thread by
:meth:`~aip_crewai.host.store.store.Store.create_action`, which documents the arguments).

Atomicity: the insert is ``ON CONFLICT (tenant, action_id) DO NOTHING``; with a reservation, the
live-reservation check, the insert and the reservation's upsert run in ONE transaction excluding
every other writer, and the reservation is written only when the row is created, so a refused request
reserves nothing and a crash cannot leave a key without its action.

Source: ARCHITECTURE.md §7 (the idempotency fence, "every store key starts with the tenant");
docs/security.md "Security" (idempotency).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..actions.lifecycle import ActionState, allowed, is_terminal
from .engines.engine import Db
from .engines.postgres import DB_NOW
from .ledger import seal_now
from .records import DISPATCH_RANK, ActionRecord, MissingTarget, Seal, StoreError
from .sql import ACTION_COLUMNS, GET_ACTION, IDEMPOTENCY_COLUMNS

__all__ = ["Target", "start_state", "create_now", "check_target_now", "holder_now", "find_read_now"]

#: A run a read names (``run_action_id``) and the operations it may be: checked by :func:`check_target_now`.
Target = tuple[str, Sequence[str]]

_S = ActionState
#: The row's values in ACTION_COLUMNS order; the lease's expiry is given as its length (ms, or NULL) and
#: computed with the database's clock (:data:`.engines.postgres.DB_NOW`).
_INSERT = (
    f"INSERT INTO actions ({ACTION_COLUMNS}) VALUES ({', '.join('?' * 19)}, {DB_NOW} + CAST(? AS BIGINT), ?, ?, ?) "
    f"ON CONFLICT (tenant, action_id) DO NOTHING RETURNING {ACTION_COLUMNS}"
)
_RESERVE = (
    f"INSERT INTO idempotency ({IDEMPOTENCY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (tenant, key) DO UPDATE SET capability_id = excluded.capability_id, "
    "action_id = excluded.action_id, input_hash = excluded.input_hash, "
    "created_at = excluded.created_at, expires_at = excluded.expires_at"
)


def start_state(status: str, dispatch: str, result: tuple[str, str] | None) -> tuple[str, str | None]:
    """The ``(status, result_json)`` a new action row is stored with: ``status`` (``pending_approval`` or
    ``running``), or ``result`` when the action already ran (a terminal status the lifecycle allows
    after ``status``).

    Raises:
        ValueError: another starting status, an unknown dispatch, or a result the lifecycle forbids.
    """
    if status not in (_S.PENDING_APPROVAL.value, _S.RUNNING.value):
        raise ValueError(f"an action starts pending_approval or running, not {status!r}")
    if dispatch not in DISPATCH_RANK:
        raise ValueError(f"unknown dispatch {dispatch!r}")
    if result is None:
        return status, None
    if not allowed(_S(status), _S(result[0])) or not is_terminal(result[0]):
        raise ValueError(f"an action created {status} cannot be stored {result[0]}")
    return result


def create_now(
    db: Db,
    row: Sequence[Any],
    *,
    reservation: tuple[str, int] | None,
    target: Target | None,
    seal: Seal | None = None,
    then: Callable[[ActionRecord], object] | None = None,
) -> tuple[bool, ActionRecord]:
    """Insert the action ``row`` (its values in :data:`.sql.ACTION_COLUMNS` order) unless its
    ``(tenant, action_id)`` exists (on the worker, in the caller's write).

    Args:
        reservation: ``(idempotency key, expires_at ms)``: first return the OTHER action a live
            reservation of the key points at (nothing written), else write the reservation with the row,
            all in one transaction. None: no reservation.
        target: ``(run_action_id, operations)``: insert only when that action of the same tenant, crew
            and principal, of one of ``operations``, exists.
        seal: what a row created with its result leaves, in the same transaction (:func:`.ledger.seal_now`).
        then: called with a created record, in the same transaction (a governed action's pending approval).

    Returns:
        ``(created, record)``: see :meth:`~aip_crewai.host.store.store.Store.create_action`.

    Raises:
        MissingTarget: ``target`` names no such action (nothing was written).
        StoreError: the row vanished after a conflicting insert.
    """
    tenant, action_id, capability_id, crew_id, _, _, input_hash, principal_id = row[:8]
    now = row[16]

    def create() -> tuple[bool, ActionRecord]:
        if reservation is not None:
            other = holder_now(db, tenant, reservation[0], now, action_id)
            if other is not None:
                return False, other
        if target is not None:
            check_target_now(db, tenant, crew_id, principal_id, target)
        rows = db.fetch(_INSERT, row)
        if rows:
            if reservation is not None:
                key, expires_at = reservation
                db.change(_RESERVE, (tenant, key, capability_id, action_id, input_hash, now, expires_at))
            record = ActionRecord(*rows[0])
            if then is not None:
                then(record)
            return True, record if seal is None else seal_now(db, record, seal)
        rows = db.fetch(GET_ACTION, (tenant, action_id))
        if not rows:
            raise StoreError("action vanished after creation")
        return False, ActionRecord(*rows[0])

    return db.transaction(create) if reservation is not None or seal is not None or then is not None else create()


def check_target_now(db: Db, tenant: str, crew_id: str, principal_id: str, target: Target) -> None:
    """Raise MissingTarget unless ``tenant`` has the action ``target[0]`` of ``crew_id``, submitted by
    ``principal_id`` (an invoker reads its own runs), of one of the operations ``target[1]`` (on the worker)."""
    run_action_id, operations = target
    found = db.fetch(
        "SELECT 1 FROM actions WHERE tenant = ? AND action_id = ? AND crew_id = ? AND principal_id = ? "
        f"AND operation IN ({', '.join('?' * len(operations))})",
        (tenant, run_action_id, crew_id, principal_id, *operations),
    )
    if not found:
        raise MissingTarget(run_action_id)


def holder_now(db: Db, tenant: str, key: str, now: int, action_id: str) -> ActionRecord | None:
    """The action other than ``action_id`` a live reservation of ``key`` points at at ``now`` (epoch ms), on
    the worker; None: the key is free, expired, or ``action_id``'s own."""
    rows = db.fetch(
        f"SELECT {ACTION_COLUMNS} FROM actions WHERE (tenant, action_id) = "
        "(SELECT tenant, action_id FROM idempotency WHERE tenant = ? AND key = ? AND expires_at > ? "
        "AND action_id != ?)",
        (tenant, key, now, action_id),
    )
    # A live reservation whose action row is missing (left by a crash of an older
    # version between two commits) holds nothing: create_now's upsert takes it over.
    return ActionRecord(*rows[0]) if rows else None


def find_read_now(
    db: Db,
    tenant: str,
    action_id: str,
    crew_id: str,
    principal_id: str,
    target: Target | None,
    key: str | None,
    now: int,
) -> ActionRecord | None:
    """What :func:`create_now` finds for a submission whose action id may be stored, read on the worker with
    nothing written, in create_now's order: the other action a live reservation of ``key`` points at at
    ``now`` (:func:`holder_now`); then the ``target`` check (:func:`check_target_now`) when one is given;
    then the stored action ``action_id`` (a repeat). None: nothing of these is stored (the caller creates)."""
    if key is not None and (other := holder_now(db, tenant, key, now, action_id)) is not None:
        return other
    if target is not None:
        check_target_now(db, tenant, crew_id, principal_id, target)
    rows = db.fetch(GET_ACTION, (tenant, action_id))
    return ActionRecord(*rows[0]) if rows else None
