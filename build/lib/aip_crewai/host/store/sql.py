"""SQL text the store's modules share, written once: the column lists of the record types, the one
read of an action row, and the one UPDATE that moves an action between states.

Source: ARCHITECTURE.md §9 (the store's ``UPDATE ... WHERE status IN (sources)``), §10.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from ..actions.lifecycle import ActionState, allowed
from .records import DISPATCH_RANK, ActionRecord, ApprovalRecord, IdempotencyRecord


def _columns(record_type: type) -> str:
    return ", ".join(f.name for f in fields(record_type) if f.name != "created")


ACTION_COLUMNS = _columns(ActionRecord)
IDEMPOTENCY_COLUMNS = _columns(IdempotencyRecord)
APPROVAL_COLUMNS = _columns(ApprovalRecord)
#: The one read of an action row, by (tenant, action id).
GET_ACTION = f"SELECT {ACTION_COLUMNS} FROM actions WHERE tenant = ? AND action_id = ?"
#: The condition of an action no start of which can be on its way to a sidecar (see :func:`action_update`).
UNSTARTED_SQL = "AND (sidecar IS NULL OR dispatch = 'not_sent') "
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
    sidecar: str | None = None,
    unstarted: bool = False,
) -> tuple[str, tuple[Any, ...]]:
    """The one UPDATE (SQL, parameters) moving an action between states (see :meth:`Store.update_action`).
    ``settle_dispatch``: write ``dispatch`` as given even when it is behind the stored one.
    ``replacing``: change the row only while its ``result_json`` is exactly this (a correction of a stored result).
    ``sidecar``: the action's placement (docs/operating.md "Several sidecars"; None keeps the stored one).
    ``unstarted``: change the row only while no start of it can be on its way to a sidecar (not placed yet,
    or dispatch ``not_sent``: every start is sent after a ``mark_sent`` that records both; ARCHITECTURE.md §8).
    The parameters end with ``tenant, action_id`` and the source statuses (then ``replacing``).

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
        "approval_id = COALESCE(?, approval_id), sidecar = COALESCE(?, sidecar) "
        f"WHERE tenant = ? AND action_id = ? AND status IN ({marks}) "
        f"{UNSTARTED_SQL if unstarted else ''}"
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
        sidecar,
        tenant,
        action_id,
        *[s.value for s in sources],
        *([replacing] if replacing is not None else []),
    )
