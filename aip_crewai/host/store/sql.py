"""SQL text the store's modules share, written once: the column lists of the record types, the one
read of an action row, the one UPDATE that moves an action between states, and the chunk log.

An action's chunk log (:func:`append_now`, :data:`LIST_CHUNKS`; run on a store worker thread by
:meth:`~aip_crewai.host.store.store.Store.append_chunks` and ``list_chunks``, which document the arguments):
a batch is one transaction: sequences already stored are skipped, nothing is appended once the action is
terminal (no chunk ever follows the result), the action's ``chunk_count`` and its dispatch (forward only)
move with it, and a shared store's followers are notified at its commit (:func:`.notify.send`).

Source: ARCHITECTURE.md §9 (the store's ``UPDATE ... WHERE status IN (sources)``), §7 (the stream), §10.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any

from ..actions.lifecycle import ActionState, allowed, is_terminal
from . import notify
from .engine import Db
from .records import DISPATCH_RANK, ActionRecord, ApprovalRecord, IdempotencyRecord, StoreError


def _columns(record_type: type) -> str:
    return ", ".join(f.name for f in fields(record_type) if f.name != "created")


ACTION_COLUMNS = _columns(ActionRecord)
IDEMPOTENCY_COLUMNS = _columns(IdempotencyRecord)
APPROVAL_COLUMNS = _columns(ApprovalRecord)
#: The one read of an action row, by (tenant, action id).
GET_ACTION = f"SELECT {ACTION_COLUMNS} FROM actions WHERE tenant = ? AND action_id = ?"
DISPATCH_RANK_SQL = "CASE dispatch WHEN 'not_sent' THEN 0 WHEN 'sent' THEN 1 ELSE 2 END"


def action_update(
    tenant: str,
    action_id: str,
    *,
    from_statuses: Iterable[str],
    status: str,
    now: int,
    dispatch: str | None = None,
    result_json: str | None = None,
    error_json: str | None = None,
    approval_id: str | None = None,
    settle_dispatch: bool = False,
    replacing: str | None = None,
) -> tuple[str, tuple[Any, ...]]:
    """The one UPDATE (SQL, parameters) moving an action between states (see :meth:`Store.update_action`).
    ``settle_dispatch``: write ``dispatch`` as given even when it is behind the stored one.
    ``replacing``: change the row only while its ``result_json`` is exactly this (a correction of a stored result).

    Raises:
        ValueError: a transition no event of the lifecycle table makes
            (:func:`aip_crewai.host.actions.lifecycle.allowed`), or an unknown dispatch.
    """
    sources = [ActionState(s) for s in from_statuses]
    target = ActionState(status)
    if not sources or any(not allowed(s, target) for s in sources):
        raise ValueError(f"transition {[s.value for s in sources]} -> {target.value} is not allowed")
    if dispatch is not None and dispatch not in DISPATCH_RANK:
        raise ValueError(f"unknown dispatch {dispatch!r}")
    marks = ", ".join("?" * len(sources))
    sql = (
        "UPDATE actions SET status = ?, updated_at = ?, "
        f"dispatch = CASE WHEN CAST(? AS TEXT) IS NOT NULL AND ? > {DISPATCH_RANK_SQL} THEN CAST(? AS TEXT) "
        "ELSE dispatch END, "
        "result_json = COALESCE(?, result_json), error_json = COALESCE(?, error_json), "
        f"approval_id = COALESCE(?, approval_id) WHERE tenant = ? AND action_id = ? AND status IN ({marks}) "
        f"{'AND result_json = ? ' if replacing is not None else ''}RETURNING {ACTION_COLUMNS}"
    )
    rank = len(DISPATCH_RANK) if settle_dispatch else DISPATCH_RANK.get(dispatch or "", -1)
    return sql, (
        target.value,
        now,
        dispatch,
        rank,
        dispatch,
        result_json,
        error_json,
        approval_id,
        tenant,
        action_id,
        *[s.value for s in sources],
        *([replacing] if replacing is not None else []),
    )


# --- the chunk log ---------------------------------------------------------------

#: Chunks of ``(tenant, action_id)`` with ``sequence > ?``, ascending, at most ``?``.
LIST_CHUNKS = (
    "SELECT sequence, chunk_json FROM chunks WHERE tenant = ? AND action_id = ? AND sequence > ? "
    "ORDER BY sequence LIMIT ?"
)


def append_now(
    db: Db,
    tenant: str,
    action_id: str,
    chunks: Sequence[tuple[int, str]],
    dispatch: str | None,
    fence: tuple[str, tuple[Any, ...]] = ("", ()),
) -> int:
    """Append ``(sequence, chunk_json)`` pairs to the action in one transaction (on the worker, in the
    caller's write); move its dispatch forward to ``dispatch`` (None keeps it). Returns how many were
    inserted, or -1 when ``fence`` (an SQL condition on the action's row and its parameters: the writer's
    lease token, :meth:`Store._fenced`) does not hold: nothing is written then.

    Raises:
        StoreError: the action does not exist (foreign key).
    """
    rows = [(tenant, action_id, seq, text) for seq, text in chunks]
    rank = DISPATCH_RANK.get(dispatch or "", -1)

    def insert() -> int:
        condition, params = fence
        state = db.fetch(
            f"SELECT status, CASE WHEN 1 = 1{condition} THEN 1 ELSE 0 END FROM actions "
            "WHERE tenant = ? AND action_id = ?",
            (*params, tenant, action_id),
        )
        if state and is_terminal(state[0][0]):
            return 0  # the result is written: a late batch (a discarded dispatch's) never follows it
        if state and not state[0][1]:
            return -1  # the writer's lease token is not current (checked under the writer lock)
        inserted = db.change_many(
            "INSERT INTO chunks (tenant, action_id, sequence, chunk_json) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (tenant, action_id, sequence) DO NOTHING",
            rows,
        )
        db.change(
            "UPDATE actions SET chunk_count = chunk_count + ?, "
            f"dispatch = CASE WHEN CAST(? AS TEXT) IS NOT NULL AND ? > {DISPATCH_RANK_SQL} "
            "THEN CAST(? AS TEXT) ELSE dispatch END WHERE tenant = ? AND action_id = ?",
            (inserted, dispatch, rank, dispatch, tenant, action_id),
        )
        notify.send(db, tenant, action_id)
        return inserted

    try:
        return db.transaction(insert)
    except db.integrity_error as exc:
        raise StoreError(f"cannot append chunks to unknown action {action_id!r}") from exc
