"""An action's chunk log: appending a batch of stream chunks, and reading them back in order
(functions over :class:`.engine.Db`, run on a store worker thread by
:meth:`~aip_crewai.host.store.store.Store.append_chunks` and ``list_chunks``, which document the arguments).

A batch is one transaction: sequences already stored are skipped, nothing is appended once the action is
terminal (no chunk ever follows the result), the action's ``chunk_count`` and its dispatch (forward only)
move with it, and a shared store's followers are notified at its commit (:func:`.notify.send`).

Source: ARCHITECTURE.md §7 (the stream), §10 (live followers).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..actions.lifecycle import is_terminal
from . import notify
from .engine import Db
from .records import DISPATCH_RANK, StoreError
from .sql import DISPATCH_RANK_SQL

__all__ = ["LIST_CHUNKS", "append_now"]

#: Chunks of ``(tenant, action_id)`` with ``sequence > ?``, ascending, at most ``?``.
LIST_CHUNKS = (
    "SELECT sequence, chunk_json FROM chunks WHERE tenant = ? AND action_id = ? AND sequence > ? "
    "ORDER BY sequence LIMIT ?"
)


def append_now(db: Db, tenant: str, action_id: str, chunks: Sequence[tuple[int, str]], dispatch: str | None) -> int:
    """Append ``(sequence, chunk_json)`` pairs to the action in one transaction (on the worker, in the
    caller's write); move its dispatch forward to ``dispatch`` (None keeps it). Returns how many were inserted.

    Raises:
        StoreError: the action does not exist (foreign key).
    """
    rows = [(tenant, action_id, seq, text) for seq, text in chunks]
    rank = DISPATCH_RANK.get(dispatch or "", -1)

    def insert() -> int:
        state = db.fetch("SELECT status FROM actions WHERE tenant = ? AND action_id = ?", (tenant, action_id))
        if state and is_terminal(state[0][0]):
            return 0  # the result is written: a late batch (a discarded dispatch's) never follows it
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
