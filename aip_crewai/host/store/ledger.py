"""An action's append-only records: its chunk log (appending a batch of stream chunks, reading them back
in order), and what its result leaves (its usage row and its signed receipt, written by :func:`seal_now`
in the result's own transaction; the usage totals and receipts read back). Functions over
:class:`.engines.engine.Db`, run on a store worker thread by the methods of :class:`LedgerMethods` (a part of
:class:`~aip_crewai.host.store.store.Store`, one of its base classes), which document the arguments.

A batch is one transaction: sequences already stored are skipped, nothing is appended once the action is
terminal (no chunk ever follows the result; only a correction's own write backfills the chunks of the stream
its result ends, :func:`backfill_now`), the action's ``chunk_count`` and its dispatch (forward only)
move with it, and a shared store's followers are notified at its commit (:func:`.notify.send`). A batch
written on behalf of an action whose dispatch lease this host holds is conditional on its fencing token
(:mod:`.leases`): a stale holder's batch is refused whole.

Source: ARCHITECTURE.md §7 (the stream), §10 (live followers); docs/observing.md "Observing actions".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..actions.lifecycle import is_terminal
from . import notify
from .engines.engine import Db
from .outbox import enqueue_now
from .records import DISPATCH_RANK, ActionRecord, ChunkRecord, Seal, StoreError, UsageTotal
from .sql import DISPATCH_RANK_SQL, GET_ACTION

__all__ = [
    "GET_RECEIPT",
    "LIST_CHUNKS",
    "RECEIPTS_OF_ACTION",
    "LedgerMethods",
    "append_now",
    "backfill_now",
    "seal_now",
    "usage_totals",
]

_T = TypeVar("_T")

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


_INSERT_CHUNK = (
    "INSERT INTO chunks (tenant, action_id, sequence, chunk_json) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (tenant, action_id, sequence) DO NOTHING"
)


def backfill_now(db: Db, record: ActionRecord, chunks: Sequence[tuple[int, str]]) -> ActionRecord:
    """Inside a correction's write (on the worker, in the transaction that just replaced ``record``'s result
    under the writer's fence, :meth:`Store.update_action` ``chunks=``): insert the ``(sequence, chunk_json)``
    pairs the action lacks, keyed by sequence (one already stored is never duplicated nor changed), and
    count them in ``chunk_count``. The one write that adds chunks to an ended action: its stream, backfilled
    from the sidecar's journal (ARCHITECTURE.md §9 "Final results"). Returns ``record`` with its new count."""
    if not chunks:
        return record
    inserted = db.change_many(_INSERT_CHUNK, [(record.tenant, record.action_id, seq, text) for seq, text in chunks])
    if inserted:
        db.change(
            "UPDATE actions SET chunk_count = chunk_count + ? WHERE tenant = ? AND action_id = ?",
            (inserted, record.tenant, record.action_id),
        )
    return dataclasses.replace(record, chunk_count=record.chunk_count + inserted)


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
    lease token, ``LeaseMethods._fenced`` in :mod:`.leases`) does not hold: nothing is written then.

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
        inserted = db.change_many(_INSERT_CHUNK, rows)
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
    if sealed.result_json != record.result_json:  # a read answered inline was inserted sealed already
        db.change(
            "UPDATE actions SET result_json = ? WHERE tenant = ? AND action_id = ?",
            (sealed.result_json, record.tenant, record.action_id),
        )
    if sealed.usage is not None:
        db.change(_UPSERT_USAGE, sealed.usage)
    if sealed.receipt is not None:
        db.change(_INSERT_RECEIPT, sealed.receipt)
    if sealed.outbox:
        enqueue_now(db, sealed.outbox)
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


class LedgerMethods:
    """The chunk log, usage and receipt methods of :class:`~aip_crewai.host.store.store.Store` (a base
    class, never used alone; the approval methods are split out the same way, :mod:`.approvals`)."""

    if TYPE_CHECKING:  # provided by Store (and its lease methods, :mod:`.leases`)
        _db: Db

        async def _run(self, fn: Callable[..., _T], *args: Any) -> _T: ...
        async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...
        def _write_now(self, durable: bool, fn: Callable[[], _T]) -> _T: ...
        def _fenced(self, tenant: str, action_id: str, token: int | None = None) -> tuple[str, tuple[Any, ...]]: ...
        def _check_fence_now(self, tenant: str, action_id: str, token: int | None = None) -> None: ...

    async def append_chunks(
        self,
        tenant: str,
        action_id: str,
        chunks: Sequence[tuple[int, str]],
        *,
        dispatch: str | None = None,
        durable: bool = True,
        lease_token: int | None = None,
    ) -> int:
        """Append ``(sequence, chunk_json)`` pairs in one transaction; sequences
        already stored are skipped, and nothing is appended once the action is
        terminal (a batch of a cancelled dispatch that reaches the store after the
        canceller's result write, on another pooled connection or another host,
        is dropped: no chunk ever follows the result). Returns how many were inserted.

        Args:
            dispatch: also move the action's dispatch forward to this, in the
                same transaction (never backward; None keeps it).
            durable: see the module docstring.
            lease_token: the fencing token the writer works under (a dispatch's, kept by its
                :class:`~aip_crewai.host.actions.chunk_sink.ChunkSink`): the batch is fenced by it even
                after this host forgot it (a renewal that found the lease taken). None: this host's token.

        When this host holds the action's dispatch lease (or ``lease_token`` is given), the batch (chunks,
        count, dispatch) is written only while that fencing token is current.

        Raises:
            StoreError: the action does not exist (foreign key).
            LeaseLost: another host took this host's lease on the action; nothing was written.
            ValueError: an unknown dispatch.
        """
        if not chunks:
            return 0
        if dispatch is not None and dispatch not in DISPATCH_RANK:
            raise ValueError(f"unknown dispatch {dispatch!r}")
        batch = tuple(chunks)
        fence = self._fenced(tenant, action_id, lease_token)

        def append() -> int:
            inserted = append_now(self._db, tenant, action_id, batch, dispatch, fence)
            if inserted < 0:  # the fence refused the batch
                self._check_fence_now(tenant, action_id, lease_token)
                return 0
            return inserted

        return await self._run(self._write_now, durable, append)

    async def list_chunks(
        self, tenant: str, action_id: str, after_sequence: int = -1, limit: int = 1000
    ) -> list[ChunkRecord]:
        """Chunks with ``sequence > after_sequence``, ascending, at most ``limit``."""
        rows = await self._fetch(LIST_CHUNKS, (tenant, action_id, after_sequence, limit))
        return [ChunkRecord(*row) for row in rows]

    async def follow_page(
        self, tenant: str, action_id: str, after_sequence: int, limit: int
    ) -> tuple[list[ChunkRecord], ActionRecord | None]:
        """One read of a stream follower: the chunks of :meth:`list_chunks`, THEN the action row (None: no
        such action), in one hop to the store's worker instead of two. The order is the follower's rule: a
        row read after the chunks tells whether chunks remain (``chunk_count``) or the stream has ended
        (ARCHITECTURE.md §10, live followers)."""

        def read(db: Db) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
            chunks = db.fetch(LIST_CHUNKS, (tenant, action_id, after_sequence, limit))
            return chunks, db.fetch(GET_ACTION, (tenant, action_id))

        chunk_rows, action_rows = await self._run(read, self._db)
        return [ChunkRecord(*row) for row in chunk_rows], ActionRecord(*action_rows[0]) if action_rows else None

    async def get_receipt(self, tenant: str, receipt_id: str) -> str | None:
        """The receipt document ``receipt_id`` of ``tenant`` (canonical JSON text), or None."""
        rows = await self._fetch(GET_RECEIPT, (tenant, receipt_id))
        return str(rows[0][0]) if rows else None

    async def receipts_of_action(self, tenant: str, action_id: str) -> list[str]:
        """The receipt documents of one action, oldest first (at most one: its final result's)."""
        return [str(row[0]) for row in await self._fetch(RECEIPTS_OF_ACTION, (tenant, action_id))]

    async def usage_totals(self, tenant: str, from_ms: int, to_ms: int) -> list[UsageTotal]:
        """``tenant``'s usage per crew and currency of results finished in ``[from_ms, to_ms)`` (ms)."""
        return await self._run(usage_totals, self._db, tenant, from_ms, to_ms)
