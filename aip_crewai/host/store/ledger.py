"""An action's append-only records: its chunk log (appending a batch of stream chunks, reading them back
in order), and what its result leaves (its usage row and its signed receipt, written by :func:`seal_now`
in the result's own transaction; the usage totals and receipts read back). Functions over
:class:`.engine.Db`, run on a store worker thread by the :class:`~aip_crewai.host.store.store.Store`
methods, which document the arguments.

A batch is one transaction: sequences already stored are skipped, nothing is appended once the action is
terminal (no chunk ever follows the result), the action's ``chunk_count`` and its dispatch (forward only)
move with it, and a shared store's followers are notified at its commit (:func:`.notify.send`).

Source: ARCHITECTURE.md §7 (the stream), §10 (live followers); README "Observing actions".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..actions.lifecycle import is_terminal
from . import notify
from .engine import Db
from .records import DISPATCH_RANK, ActionRecord, Seal, StoreError, UsageTotal
from .sql import DISPATCH_RANK_SQL

__all__ = ["GET_RECEIPT", "LIST_CHUNKS", "RECEIPTS_OF_ACTION", "append_now", "seal_now", "usage_totals"]

_UPSERT_USAGE = (
    "INSERT INTO action_usage (tenant, action_id, crew_id, operation, finished_at, prompt_tokens, "
    "completion_tokens, total_tokens, cached_tokens, requests, latency_ms, cost_picos, currency) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, action_id) DO UPDATE SET "
    "finished_at = excluded.finished_at, prompt_tokens = excluded.prompt_tokens, "
    "completion_tokens = excluded.completion_tokens, total_tokens = excluded.total_tokens, "
    "cached_tokens = excluded.cached_tokens, requests = excluded.requests, latency_ms = excluded.latency_ms, "
    "cost_picos = excluded.cost_picos, currency = excluded.currency"
)
_INSERT_RECEIPT = (
    "INSERT INTO receipts (tenant, receipt_id, action_id, approval_id, hash, document, created_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, receipt_id) DO NOTHING"
)
#: One receipt document by (tenant, receipt id).
GET_RECEIPT = "SELECT document FROM receipts WHERE tenant = ? AND receipt_id = ?"
#: The receipt documents of (tenant, action id), oldest first.
RECEIPTS_OF_ACTION = "SELECT document FROM receipts WHERE tenant = ? AND action_id = ? ORDER BY created_at, receipt_id"
#: Per crew and currency, in [from, to): counts and sums. A cost is summed as whole micro-units and the
#: rest, so neither sum overflows a 64-bit integer before 9.2e12 currency units.
_USAGE_TOTALS = (
    "SELECT crew_id, currency, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(total_tokens), "
    "SUM(cached_tokens), SUM(requests), SUM(latency_ms), SUM(cost_picos / 1000000), SUM(cost_picos % 1000000) "
    "FROM action_usage WHERE tenant = ? AND finished_at >= ? AND finished_at < ? "
    "GROUP BY crew_id, currency ORDER BY crew_id, currency"
)

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


def seal_now(db: Db, record: ActionRecord, seal: Seal) -> ActionRecord:
    """Inside a result's write (on the worker, in its transaction): call ``seal`` with the action as just
    written and its approval's decision proof, then store the result with its usage and receipt
    reference, the usage row (replacing an earlier one) and the receipt (kept if one exists).
    Returns the record as finally written."""
    proof = None
    if record.approval_id is not None:
        rows = db.fetch(
            "SELECT decision_proof FROM approvals WHERE tenant = ? AND approval_id = ?",
            (record.tenant, record.approval_id),
        )
        proof = rows[0][0] if rows else None
    sealed = seal(record, proof)
    if sealed is None:
        return record
    db.change(
        "UPDATE actions SET result_json = ? WHERE tenant = ? AND action_id = ?",
        (sealed.result_json, record.tenant, record.action_id),
    )
    if sealed.usage is not None:
        db.change(_UPSERT_USAGE, sealed.usage)
    if sealed.receipt is not None:
        db.change(_INSERT_RECEIPT, sealed.receipt)
    return dataclasses.replace(record, result_json=sealed.result_json)


def usage_totals(db: Db, tenant: str, from_ms: int, to_ms: int) -> list[UsageTotal]:
    """The tenant's usage per crew (and currency) of results finished in ``[from_ms, to_ms)``."""
    totals = []
    for row in db.fetch(_USAGE_TOTALS, (tenant, from_ms, to_ms)):
        crew_id, currency, actions, prompt, completion, total, cached, requests, latency, micro, rest = row
        cost = None if micro is None else int(micro) * 1_000_000 + int(rest)
        p, c, t, k, r, ms = (int(v or 0) for v in (prompt, completion, total, cached, requests, latency))
        totals.append(UsageTotal(str(crew_id), currency, int(actions), p, c, t, k, r, ms, cost))
    return totals
