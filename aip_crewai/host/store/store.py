"""The host store: named async methods over the host database (stdlib sqlite3 on one worker thread).

One file, WAL, ``synchronous=FULL``, one connection owned by the app's
lifespan. Every table's primary key starts with ``tenant`` and every method
takes ``tenant`` first, so one tenant cannot address another's rows by
construction (the periodic sweeps :meth:`Store.expire_approvals` and
:meth:`Store.purge_message_ids` are the only tenant-less methods and return
the tenant of every row they touch). Timestamps are integers, milliseconds
since the Unix epoch (UTC); :func:`ms_to_rfc3339` renders them at the edges.

Atomicity: every decision that must happen once (message-id claim, action
creation, status transitions, approval decisions) is ONE SQL statement whose
``WHERE``/``ON CONFLICT`` clause decides, so it holds across connections too;
an idempotency reservation is written in the same ``BEGIN IMMEDIATE``
transaction as the action row it points at (:meth:`Store.create_action`).

Durability: every commit is fsynced (``synchronous=FULL``) unless the caller
passes ``durable=False``, which runs that one write with
``synchronous=NORMAL``: it is atomic and survives a crash of the host
process, but a power loss may roll it back; WAL frames are appended in
order, so the next durable commit makes it durable too. The action service
uses it only where losing the write costs nothing: actions of read-only
operations without an idempotency key (a status read leaves no side effect and
no fence), and chunk appends (like the sidecar's chunk checkpoints, ARCHITECTURE.md
§5: the result commit that ends the action is durable and covers them).

Threading: the ``sqlite3`` connection lives on one dedicated worker thread and
every store method runs ALL its statements there as one function (one thread
hop per method, not one per statement and cursor call as with aiosqlite,
whose hops cost about 85 µs each on the benchmark machine). Calls are thereby
serialized, so a multi-statement transaction never swallows another
coroutine's write, and a cancelled caller never leaves a transaction half
done: the function runs to its end on the worker. A PostgreSQL store runs its
methods the same way on ``pool_size`` worker threads, each method on one
connection checked out of a pool for its whole run (:class:`.engines.postgres.PostgresDb`):
reads run side by side, writes serialize on the writer lock.

File safety: the database is created 0600 (an existing file, or its
``-wal``/``-shm`` companions, with any group/other bit is refused, as is a
symlink); its directory must not be group- or world-writable.

The package's parts: the row types and errors (:mod:`.records`, re-exported
here), the schema (:mod:`.migrations`), the SQL text shared by the store's
modules (:mod:`.sql`), the engines in their own sub-package: one module per engine behind
:class:`.engines.engine.Db` (:mod:`.engines.sqlite`: opening the file, its pre-flight
:func:`check_store_file`; :mod:`.engines.postgres`), an action's creation with its idempotency reservation
(:mod:`.creation`), dispatch leases and their fencing tokens (:mod:`.leases`), an action's
append-only records: the chunk log, usage and receipts (:mod:`.ledger`), the cross-host ``NOTIFY``
(:mod:`.notify`), and the approval methods (:mod:`.approvals`, the store's
base class). No other host module runs SQL.

Source: ARCHITECTURE.md §7 (fences, "every store key starts with the tenant"),
ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import structlog

from ...plumbing.storage import create_private_file, hop, start_worker
from ...plumbing.wakeup import ChangeSignal
from ..actions.lifecycle import ActionState, is_terminal
from . import notify
from .approvals import ApprovalMethods
from .creation import Target, create_now, find_read_now, start_state
from .engines.engine import Db
from .engines.postgres import CallGuard, PostgresDb, StoreTimeouts, is_postgres_url, open_postgres_pool
from .engines.sqlite import SqliteDb, check_location, check_store_file, connect_sqlite, lock_store
from .leases import LeaseMethods
from .ledger import LedgerMethods, backfill_now, seal_now
from .migrations import MIGRATIONS, migrate
from .outbox import OutboxMethods
from .records import (
    DISPATCH_RANK,
    ActionRecord,
    ApprovalEvent,
    ApprovalPage,
    ApprovalRecord,
    ChunkRecord,
    IdempotencyRecord,
    InsecureStorePath,
    InvalidCursor,
    LeaseLost,
    MissingTarget,
    Seal,
    SealedRows,
    StoreError,
    StoreLocked,
    StoreUnavailable,
    UnusableStore,
    UsageTotal,
    ms_to_rfc3339,
    rfc3339_to_ms,
)
from .sql import ACTION_COLUMNS, GET_ACTION, action_update

__all__ = [
    "MIGRATIONS",
    "ActionState",
    "DISPATCH_RANK",
    "Store",
    "StoreError",
    "InsecureStorePath",
    "InvalidCursor",
    "MissingTarget",
    "ActionRecord",
    "IdempotencyRecord",
    "ApprovalRecord",
    "ApprovalPage",
    "ApprovalEvent",
    "ChunkRecord",
    "Seal",
    "SealedRows",
    "UsageTotal",
    "StoreUnavailable",
    "LeaseLost",
    "check_location",
    "check_store_file",
    "migrate",
    "UnusableStore",
    "StoreLocked",
    "lock_store",
    "ms_to_rfc3339",
    "rfc3339_to_ms",
]


log = structlog.get_logger(__name__)
_S = ActionState
#: How long a dispatch lease lasts unless renewed, ms (``[host] lease_seconds``).
DEFAULT_LEASE_MS = 30_000
#: Connections (and worker threads) of a PostgreSQL store's pool (``[host] store_pool_size``).
DEFAULT_POOL_SIZE = 4
#: How long one answer of :meth:`Store.writable` (``/ready``'s store check) is reused, seconds.
PROBE_FRESH_S = 0.5
_T = TypeVar("_T")


class Store(ApprovalMethods, LeaseMethods, LedgerMethods, OutboxMethods):
    """Named async methods over the host database. Open with :meth:`open`. The approval methods (and the
    approval event log) are in :mod:`.approvals`, the dispatch leases in :mod:`.leases`, the chunk log, usage
    and receipts in :mod:`.ledger`."""

    def __init__(
        self,
        db: Db,
        worker: ThreadPoolExecutor,
        *,
        clock: Callable[[], float] = time.time,
        owner: str | None = None,
        lease_ms: int = DEFAULT_LEASE_MS,
        url: str | None = None,
    ) -> None:
        self._db = db
        self._worker = worker
        self._clock = clock
        #: Notified after every write that may have changed an approval (the
        #: approval event stream's wake-up; ARCHITECTURE.md §10 live followers).
        self.approvals_changed = ChangeSignal()
        #: This host's id in dispatch leases (None: no leases, every lease check passes).
        self.owner = owner
        #: How long a lease lasts unless renewed, ms.
        self.lease_ms = lease_ms
        self._url = url
        #: The last store method failed with StoreUnavailable (no method succeeded since).
        self.unavailable = False
        self._probe: asyncio.Future[bool] | None = None
        self._probe_at = 0.0
        self._init_leases()

    @classmethod
    async def open(
        cls,
        location: Path | str,
        *,
        clock: Callable[[], float] = time.time,
        owner: str | None = None,
        lease_ms: int = DEFAULT_LEASE_MS,
        pool_size: int = DEFAULT_POOL_SIZE,
        timeouts: StoreTimeouts | None = None,
    ) -> Store:
        """Open the store: a SQLite file (check the location, create it 0600 if missing, connect) or a
        ``postgresql://`` URL (a pool of ``pool_size`` connections, one per worker thread, each session
        bounded by ``timeouts``: :class:`~.engines.postgres.StoreTimeouts`); then apply the migrations the
        database lacks.

        Raises:
            InsecureStorePath: see :func:`check_location` (SQLite).
            StoreError: the schema is newer than this code, WAL is unavailable (SQLite), or the
                PostgreSQL server cannot be reached or holds another application's tables.
        """
        if is_postgres_url(location):
            url, bounds, guard = str(location), timeouts or StoreTimeouts(), CallGuard()
            worker, db = await start_worker(
                lambda: PostgresDb(open_postgres_pool(url, pool_size, bounds, guard), bounds, guard),
                name="aip-host-store",
                threads=pool_size,
                abandon=lambda opened: opened.close() if opened is not None else None,
            )
            return cls(db, worker, clock=clock, owner=owner, lease_ms=lease_ms, url=url)
        path = Path(location)
        check_location(path)
        create_private_file(path, UnusableStore)
        check_location(path)
        # Cancel-safe: a connection opened after the caller gave up is closed on the worker.
        worker, sqlite = await start_worker(
            lambda: SqliteDb(connect_sqlite(str(path))),
            name="aip-host-store",
            abandon=lambda opened: opened.close() if opened is not None else None,
        )
        # The database's clock (DB_NOW) of a SQLite store, which one host owns: the store's own clock.
        await hop(worker, sqlite.conn.create_function, "db_now_ms", 0, lambda: int(clock() * 1000))
        return cls(sqlite, worker, clock=clock, owner=owner, lease_ms=lease_ms)

    @property
    def url(self) -> str | None:
        """The PostgreSQL URL of a shared store (None for SQLite)."""
        return self._url

    @property
    def engine(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self._db.engine

    async def close(self) -> None:
        await hop(self._worker, self._db.close)
        self._worker.shutdown(wait=True)

    def now_ms(self) -> int:
        """The store clock, epoch milliseconds."""
        return int(self._clock() * 1000)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on a store worker thread with a connection for all its statements
        (:meth:`Db.run`: SQLite's one connection, or one of PostgreSQL's pooled ones).

        A call past the engine's call bound (:attr:`Db.call_timeout_s`: the server does not answer at
        all) is given up: its caller gets StoreUnavailable at the bound, and the stuck connections are
        interrupted (:meth:`Db.interrupt_stuck`) so their threads and pool slots come back.

        Raises:
            StoreUnavailable: the database cannot serve the call now (:attr:`Db.unavailable_errors`: down,
                past a timeout, read-only; a SQLite file full, failing, read-only or write-locked from
                outside), or the call exceeded the bound. docs/operating.md "Faults and their bounds".
        """
        bound = self._db.call_timeout_s
        try:
            if bound is None:  # no bound (SQLite): no cancel scope either, which costs a call about 10 µs
                value = await hop(self._worker, self._db.run, fn, *args)
            else:
                with anyio.fail_after(bound):  # never asyncio.wait_for: see plumbing/wakeup.py
                    value = await hop(self._worker, self._db.run, fn, *args)
        except TimeoutError:
            interrupted = self._db.interrupt_stuck()
            log.warning("store_call_timed_out", bound_ms=int((bound or 0) * 1000), interrupted=interrupted)
            self.unavailable = True
            raise StoreUnavailable(f"the host store did not answer within {int((bound or 0) * 1000)} ms") from None
        except self._db.unavailable_errors as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("store_unavailable", error=type(exc).__name__, detail=first[:200])
            self.unavailable = True
            raise StoreUnavailable() from exc
        self.unavailable = False
        return cast(_T, value)

    async def probe(self) -> bool:
        """Whether the store can take a write now: on PostgreSQL a writer transaction (the writer lock
        within the lock timeout) on a database that is not read-only, within the call bound; on SQLite
        a read, with no call failed for a full disk, an I/O error, a read-only file or an outside write
        lock in the last 30 s and no write committed since (:meth:`.engines.sqlite.SqliteDb.probe`).
        False (logged) when it cannot. Never raises StoreUnavailable."""
        try:
            await self._run(self._db.probe)
        except StoreUnavailable:
            return False
        return True

    async def writable(self) -> bool:
        """:meth:`probe`, shared by concurrent callers and reused for :data:`PROBE_FRESH_S` (``/ready``
        asks often): answers within the call bound, and turns back to True by itself once the store
        recovers. docs/operating.md "Faults and their bounds"."""
        loop = asyncio.get_running_loop()
        probe = self._probe
        if probe is None or (probe.done() and loop.time() - self._probe_at > PROBE_FRESH_S):
            self._probe_at = loop.time()
            probe = self._probe = asyncio.ensure_future(self.probe())
        return await asyncio.shield(probe)

    def _fetch_now(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._db.fetch(sql, params)

    def _change_now(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._db.change(sql, params)

    def _write_now(self, durable: bool, fn: Callable[[], _T]) -> _T:
        """Run the write ``fn`` (on the worker), fsynced at commit or not (:meth:`Db.write`)."""
        return self._db.write(durable, fn)

    def _transaction_now(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` (on the worker) as one transaction excluding every other writer; roll back on any error."""
        return self._db.transaction(fn)

    async def _fetch(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple[Any, ...]]:
        return await self._run(self._fetch_now, sql, params)

    async def _change(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        return await self._run(self._change_now, sql, params)

    # --- message ids (signed envelopes, ARCHITECTURE.md §7) ---

    async def claim_message_id(
        self, tenant: str, message_id: str, expires_at: int, *, now: int | None = None, key_id: str | None = None
    ) -> bool:
        """Claim ``message_id`` until ``expires_at`` (ms), for ``key_id`` (the
        signing principal) within ``tenant``; without ``key_id``, for the tenant.

        A per-key claim is stored as ``<key_id> U+001F <message_id>`` (principal
        ids hold no control characters, so the split is unambiguous; no schema
        change). A live tenant-wide claim of the same id (written before claims
        were per key) still blocks it.

        Returns True the first time, False for a replay (an expired claim may be re-claimed).

        Source: docs/security.md "Security" (signed message ids).
        """
        now = self.now_ms() if now is None else now
        stored = message_id if key_id is None else f"{key_id}\x1f{message_id}"
        return (
            await self._change(
                "INSERT INTO message_ids (tenant, message_id, expires_at) SELECT ?, ?, ? "
                "WHERE NOT EXISTS (SELECT 1 FROM message_ids WHERE tenant = ? AND message_id = ? AND expires_at > ?) "
                "ON CONFLICT (tenant, message_id) DO UPDATE SET expires_at = excluded.expires_at "
                "WHERE message_ids.expires_at <= ?",
                (tenant, stored, expires_at, tenant, message_id, now, now),
            )
            == 1
        )

    async def purge_message_ids(self, now: int | None = None) -> int:
        """Delete expired message-id claims (all tenants); returns how many."""
        now = self.now_ms() if now is None else now
        return await self._change("DELETE FROM message_ids WHERE expires_at <= ?", (now,))

    # --- actions and the idempotency key's reservation (ARCHITECTURE.md §7) ---

    async def create_action(
        self,
        tenant: str,
        action_id: str,
        capability_id: str,
        crew_id: str,
        operation: str,
        input_json: str,
        input_hash: str,
        principal_id: str,
        idempotency_key: str | None,
        status: str,
        *,
        approval_id: str | None = None,
        timeout_ms: int | None = None,
        dispatch: str = "not_sent",
        target: Target | None = None,
        key_expires_at: int | None = None,
        now: int | None = None,
        durable: bool = True,
        result: tuple[str, str] | None = None,
        seal: Seal | None = None,
        trace_parent: str | None = None,
        sidecar: str | None = None,
        approval: tuple[str, int] | None = None,
    ) -> tuple[bool, ActionRecord]:
        """Insert an action unless ``(tenant, action_id)`` exists (``durable``: see the module docstring).

        With ``idempotency_key`` and ``key_expires_at`` (ms) the key's
        reservation is written in the SAME transaction as the action row, and
        only when the row is created: a refused request (its action id taken,
        its target missing) reserves nothing, and a crash cannot leave a key
        without its action (docs/security.md "Security": idempotency).

        Args:
            dispatch: the initial dispatch state; ``sent`` for an action whose
                dispatch starts right after this write ("the request may have
                reached the sidecar"), which saves a second write.
            target: ``(run_action_id, operations)``: insert only when the
                tenant has an action ``run_action_id`` of the same crew, submitted
                by the same principal (an invoker reads its own runs), whose
                operation is one of ``operations`` (the target check of
                status/events/cancel, in the same hop as the insert).

            key_expires_at: when the key's reservation expires, ms; None
                records no reservation (the key is still stored on the row).
            result: ``(status, result_json)``: the action already ran (a
                key-less read answered inline); the row is inserted in its
                final state: a terminal status the lifecycle allows after
                ``status`` (``running``). ValueError otherwise.
            seal: with ``result``: what the result leaves, written with a created row (:func:`.ledger.seal_now`).
            trace_parent: the W3C ``traceparent`` its dispatch continues (docs/observing.md "Observing actions").
            sidecar: its placement, recorded before its start is sent (docs/operating.md "Several sidecars").
            approval: ``(policy_hash, expires_at ms)`` of a ``pending_approval`` action: its pending approval
                (``approval_id``) is inserted with a created row, in the same transaction (ARCHITECTURE.md §7).

        Returns:
            ``(created, record)``: the new record, or the EXISTING one
            (compare its ``input_hash``) with ``created`` False. With a
            reservation, the existing record may be ANOTHER action: the one
            a live reservation of the key points at (its ``action_id``
            differs; compare ``input_hash``); nothing is written then.

        Raises:
            MissingTarget: ``target`` names no such action (nothing was written).
        """
        status, result_json = start_state(status, dispatch, result)
        seal = self._with_outbox(seal)
        now = self.now_ms() if now is None else now
        # The row in ACTION_COLUMNS order: who and what, then its state (no error, no chunk yet) and times.
        request = (tenant, action_id, capability_id, crew_id, operation, input_json, input_hash, principal_id)
        state = (idempotency_key, status, dispatch, result_json, None, approval_id, timeout_ms, 0)
        row = (*request, *state, now, now, *self._lease_for(status), trace_parent, sidecar)
        reserve = None if idempotency_key is None or key_expires_at is None else (idempotency_key, key_expires_at)

        def pending(_record: ActionRecord) -> None:  # inside the row's transaction
            policy, expires_at = approval or ("", 0)
            names = (tenant, approval_id or "", action_id, capability_id, policy, principal_id, input_json)
            self._insert_approval_now(names, now, expires_at)

        def write() -> tuple[bool, ActionRecord]:
            then = pending if approval is not None else None
            return create_now(self._db, row, reservation=reserve, target=target, seal=seal, then=then)

        run = self._approvals_write if approval is not None else self._run  # the former wakes approval streams
        created, record = await run(self._write_now, durable, write)
        if created:
            self._hold(record)
        return created, record

    async def find_read(
        self, tenant: str, action_id: str, crew_id: str, principal: str, target: Target | None, key: str | None = None
    ) -> ActionRecord | None:
        """What :meth:`create_action` would find for a submission of ``action_id``, one read with nothing written
        (:func:`.creation.find_read_now`: the other action a live reservation of ``key`` points at; MissingTarget
        unless a given ``target`` is the principal's own run of the crew; the stored action; else None)."""
        now = self.now_ms()
        return await self._run(find_read_now, self._db, tenant, action_id, crew_id, principal, target, key, now)

    async def get_action(self, tenant: str, action_id: str) -> ActionRecord | None:
        rows = await self._fetch(GET_ACTION, (tenant, action_id))
        return ActionRecord(*rows[0]) if rows else None

    async def update_action(
        self,
        tenant: str,
        action_id: str,
        *,
        from_statuses: Iterable[str],
        status: str,
        dispatch: str | None = None,
        result_json: str | None = None,
        error_json: str | None = None,
        approval_id: str | None = None,
        now: int | None = None,
        durable: bool = True,
        settle_dispatch: bool = False,
        replacing: str | None = None,
        seal: Seal | None = None,
        sidecar: str | None = None,
        unstarted: bool = False,
        chunks: Sequence[tuple[int, str]] = (),
        lease_token: int | None = None,
    ) -> ActionRecord | None:
        """Move an action from one of ``from_statuses`` to ``status``; the SQL
        ``WHERE`` enforces the source state, so a stale writer changes nothing
        (``durable``: see the module docstring).

        ``dispatch`` only moves forward (not_sent → sent → acknowledged),
        except with ``settle_dispatch``: the dispatch's own final word (e.g. a
        refused connection: ``not_sent`` after ``sent`` was recorded as
        "may have reached the sidecar"). None-valued fields keep their stored value.
        ``replacing``: only while the stored ``result_json`` is exactly this
        (a correction of a provisional result: a concurrent correction wins).
        ``seal``: what the result leaves, written in the same transaction (:func:`.ledger.seal_now`).
        ``sidecar``: the action's placement (docs/operating.md "Several sidecars"; None keeps the stored one).
        ``unstarted``: only while no start can be on its way to a sidecar (:func:`.sql.action_update`): a
        cancel serialized with the ``mark_sent`` of a dispatch on any host (ARCHITECTURE.md §8).
        ``chunks``: ``(sequence, chunk_json)`` pairs of the stream the stored result ends, read back from the
        sidecar's journal (a result corrected or settled from it): those the action lacks are appended in
        the SAME transaction, only when the row changed, keyed by sequence (never a duplicate), even though
        the action is now ended (:func:`.ledger.backfill_now`; ARCHITECTURE.md §9 "Final results").
        ``lease_token``: the fencing token the writer works under (a dispatch's or a restart follower's,
        taken with its lease: ``Store.lease_token`` right after ``Store.take_lease``): the write (with what
        the result leaves and the chunks) applies only while that token is current, even after this host
        forgot it. None: the token this host holds on the action, if any; a host holding none writes as
        before (the status conditions guard it). ARCHITECTURE.md §10 (dispatch leases), :mod:`.leases`.

        Returns:
            The updated record when the row changed, else None.

        Raises:
            ValueError: a transition outside :data:`TRANSITIONS`, or an unknown dispatch.
            LeaseLost: the writer's token (``lease_token``, else this host's) is no longer current (another
                host took the lease): nothing was written (the result, its usage and receipt included).
        """
        update = action_update(
            tenant,
            action_id,
            from_statuses=from_statuses,
            status=status,
            dispatch=dispatch,
            result_json=result_json,
            error_json=error_json,
            approval_id=approval_id,
            now=self.now_ms() if now is None else now,
            settle_dispatch=settle_dispatch,
            replacing=replacing,
            sidecar=sidecar,
            unstarted=unstarted,
        )
        token = self.lease_token(tenant, action_id) if lease_token is None else lease_token
        fence, fence_params = self._fenced(tenant, action_id, token)
        if fence:  # a lease token: the write applies only while it is current
            update = (update[0].replace(" RETURNING ", f"{fence} RETURNING ", 1), (*update[1], *fence_params))
        fenced = token if fence else None
        seal = self._with_outbox(seal)
        backfill = tuple(chunks)
        record: ActionRecord | None
        if seal is None and not backfill:
            record = await self._run(self._write_now, durable, lambda: self._update_now(update, fenced=fenced))
        else:  # the result, its chunks and what it leaves in one transaction, under the same fence
            record = await self._run(
                self._write_now,
                durable,
                lambda: self._transaction_now(lambda: self._update_now(update, seal, fenced=fenced, chunks=backfill)),
            )
        if record is not None and is_terminal(record.status):
            self._tokens.pop((tenant, action_id), None)  # no lease once it has ended
        return record

    def _update_now(
        self,
        update: tuple[str, tuple[Any, ...]],
        seal: Seal | None = None,
        *,
        fenced: int | None = None,
        chunks: Sequence[tuple[int, str]] = (),
    ) -> ActionRecord | None:
        """Apply ``update`` (on the worker); ``fenced``: the lease token it is conditional on (None: none)."""
        rows = self._fetch_now(*update)
        if not rows:
            if fenced is not None:
                tenant, action_id = update[1][9], update[1][10]  # see :func:`.sql.action_update`
                self._check_fence_now(tenant, action_id, fenced)
            return None
        record = backfill_now(self._db, ActionRecord(*rows[0]), chunks)
        if seal is not None:
            record = seal_now(self._db, record, seal)
        notify.send(self._db, record.tenant, record.action_id)  # a shared store's followers: at the commit
        return record

    async def list_in_flight(self, tenant: str | None = None) -> list[ActionRecord]:
        """Actions still ``running`` (reconciliation after a restart), oldest first."""
        where, params = (
            ("status = 'running'", ()) if tenant is None else ("status = 'running' AND tenant = ?", (tenant,))
        )
        rows = await self._fetch(f"SELECT {ACTION_COLUMNS} FROM actions WHERE {where} ORDER BY created_at", params)
        return [ActionRecord(*row) for row in rows]

    async def list_failed_with(
        self, codes: Iterable[str], markers: Iterable[str], limit: int = 100
    ) -> list[ActionRecord]:
        """``failed`` actions whose stored result's error ``code`` is one of
        ``codes`` and whose result text holds one of ``markers`` (compact JSON
        fragments such as ``"uncertain_outcome":true``), not yet marked
        ``"reconciled"``: a prefilter, the caller decides finality. Least
        recently updated first, at most ``limit`` (all tenants)."""
        codes, markers = list(codes), list(markers)
        if not codes or not markers:
            return []
        any_code = " OR ".join("result_json LIKE ?" for _ in codes)
        any_marker = " OR ".join("result_json LIKE ?" for _ in markers)
        rows = await self._fetch(
            f"SELECT {ACTION_COLUMNS} FROM actions WHERE status = 'failed' AND ({any_code}) AND ({any_marker}) "
            "AND result_json NOT LIKE '%\"reconciled\":%' ORDER BY updated_at LIMIT ?",
            (*[f'%"code":"{code}"%' for code in codes], *[f"%{marker}%" for marker in markers], limit),
        )
        return [ActionRecord(*row) for row in rows]

    async def list_awaiting_approval(self) -> list[ActionRecord]:
        """Actions still ``pending_approval`` (all tenants; the restart check of
        approvals a previous process decided or never wrote), oldest first."""
        rows = await self._fetch(
            f"SELECT {ACTION_COLUMNS} FROM actions WHERE status = 'pending_approval' ORDER BY created_at"
        )
        return [ActionRecord(*row) for row in rows]
