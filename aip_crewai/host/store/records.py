"""The host store's data model and on-disk rules: forward-only migrations,
row types, action states and transitions, the timestamp representation
(integers, ms since the Unix epoch, UTC; rendered as RFC 3339 only at the
edges), the file-location rules and the opaque cursor; the column lists and
the action-update statement :mod:`store` runs; and the opening of the file
(WAL, pragmas, :func:`migrate`) and its pre-flight check
(:func:`check_store_file`), the only SQL executed here.

Every table's primary key starts with ``tenant``. Migrations are numbered by
their position in :data:`MIGRATIONS` and tracked with ``PRAGMA user_version``;
never edit a shipped migration, append a new one.

Source: ARCHITECTURE.md §7, ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import base64
import re
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

from ...contracts.errors import AipError, Category
from ...storage import apply_migrations, database_files, directory_problem, integrity_problems, private_file_problem
from ..actions.lifecycle import ActionState, DispatchState, allowed

_MIGRATION_1 = """
CREATE TABLE actions (
    tenant          TEXT NOT NULL,
    action_id       TEXT NOT NULL,
    capability_id   TEXT NOT NULL,
    crew_id         TEXT NOT NULL,
    operation       TEXT NOT NULL,
    input_json      TEXT NOT NULL,
    input_hash      TEXT NOT NULL,
    principal_id    TEXT NOT NULL,
    idempotency_key TEXT,
    status          TEXT NOT NULL CHECK (status IN ('pending_approval', 'running', 'completed', 'failed', 'cancelled')),
    dispatch        TEXT NOT NULL CHECK (dispatch IN ('not_sent', 'sent', 'acknowledged')),
    result_json     TEXT,
    error_json      TEXT,
    approval_id     TEXT,
    timeout_ms      INTEGER,
    chunk_count     INTEGER NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (tenant, action_id)
) WITHOUT ROWID;
CREATE INDEX actions_live ON actions (status, created_at) WHERE status IN ('pending_approval', 'running');

CREATE TABLE chunks (
    tenant     TEXT NOT NULL,
    action_id  TEXT NOT NULL,
    sequence   INTEGER NOT NULL CHECK (sequence >= 0),
    chunk_json TEXT NOT NULL,
    PRIMARY KEY (tenant, action_id, sequence),
    FOREIGN KEY (tenant, action_id) REFERENCES actions (tenant, action_id)
) WITHOUT ROWID;

CREATE TABLE idempotency (
    tenant        TEXT NOT NULL,
    key           TEXT NOT NULL,
    capability_id TEXT NOT NULL,
    action_id     TEXT NOT NULL,
    input_hash    TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    expires_at    INTEGER NOT NULL,
    PRIMARY KEY (tenant, key)
) WITHOUT ROWID;

CREATE TABLE approvals (
    tenant              TEXT NOT NULL,
    approval_id         TEXT NOT NULL,
    action_id           TEXT NOT NULL,
    capability_id       TEXT NOT NULL,
    policy_hash         TEXT NOT NULL,
    requested_by        TEXT NOT NULL,
    input_snapshot_json TEXT NOT NULL,
    status              TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'denied', 'expired')),
    decision_reason     TEXT,
    decided_by          TEXT,
    decided_at          INTEGER,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (tenant, approval_id),
    FOREIGN KEY (tenant, action_id) REFERENCES actions (tenant, action_id)
) WITHOUT ROWID;
CREATE INDEX approvals_by_created ON approvals (tenant, created_at, approval_id);
CREATE INDEX approvals_by_action ON approvals (tenant, action_id);
CREATE INDEX approvals_pending_expiry ON approvals (expires_at) WHERE status = 'pending';

CREATE TABLE message_ids (
    tenant     TEXT NOT NULL,
    message_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, message_id)
) WITHOUT ROWID;
CREATE INDEX message_ids_expiry ON message_ids (expires_at);
"""

# Migration 2: an approval whose action the tenant cancelled before any decision is
# ``withdrawn`` (no longer decidable). SQLite cannot alter a CHECK: the table is rebuilt.
_MIGRATION_2 = """
CREATE TABLE approvals_v2 (
    tenant              TEXT NOT NULL,
    approval_id         TEXT NOT NULL,
    action_id           TEXT NOT NULL,
    capability_id       TEXT NOT NULL,
    policy_hash         TEXT NOT NULL,
    requested_by        TEXT NOT NULL,
    input_snapshot_json TEXT NOT NULL,
    status              TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'denied', 'expired', 'withdrawn')),
    decision_reason     TEXT,
    decided_by          TEXT,
    decided_at          INTEGER,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (tenant, approval_id),
    FOREIGN KEY (tenant, action_id) REFERENCES actions (tenant, action_id)
) WITHOUT ROWID;
INSERT INTO approvals_v2 SELECT tenant, approval_id, action_id, capability_id, policy_hash, requested_by,
    input_snapshot_json, status, decision_reason, decided_by, decided_at, created_at, expires_at FROM approvals;
DROP TABLE approvals;
ALTER TABLE approvals_v2 RENAME TO approvals;
CREATE INDEX approvals_by_created ON approvals (tenant, created_at, approval_id);
CREATE INDEX approvals_by_action ON approvals (tenant, action_id);
CREATE INDEX approvals_pending_expiry ON approvals (expires_at) WHERE status = 'pending';
"""

# Migration 3: the dispatch lease of a running action (issue 21 item 2): which host dispatches or
# reconciles it, until when (ms). A lease that is not renewed expires, and another host takes it over.
_MIGRATION_3 = """
ALTER TABLE actions ADD COLUMN lease_owner TEXT;
ALTER TABLE actions ADD COLUMN lease_expires_at INTEGER;
"""

# Migration 4 (issue 19): the proof of a signed decision (JSON: the RFC 9421 signature
# base, signature and the decision body, README "Signed requests"), and the approval
# event log of ``GET /aip/v1/approvals/events``: one row per approval created or changed
# in status, written by the store in the same transaction as the change
# (:meth:`Store._log_approval_now`). ``seq`` counts per tenant from 1 (a tenant's positions
# tell nothing about other tenants). Plain DDL: the same script serves PostgreSQL.
_MIGRATION_4 = """
ALTER TABLE approvals ADD COLUMN decision_proof TEXT;
CREATE TABLE approval_events (
    tenant      TEXT NOT NULL,
    seq         INTEGER NOT NULL CHECK (seq >= 1),
    approval_id TEXT NOT NULL,
    status      TEXT NOT NULL,
    PRIMARY KEY (tenant, seq)
) WITHOUT ROWID;
"""

#: Forward-only migrations; migration N (1-based) brings ``user_version`` to N.
MIGRATIONS: tuple[str, ...] = (_MIGRATION_1, _MIGRATION_2, _MIGRATION_3, _MIGRATION_4)


#: Dispatch states in order (only forward, see :meth:`Store.update_action`).
DISPATCH_RANK = {state.value: rank for rank, state in enumerate(DispatchState)}
APPROVAL_DECISIONS = ("approved", "denied")
_RFC3339_RE = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})[Tt ](?P<time>\d{2}:\d{2}:\d{2})(?:\.(?P<fraction>\d{1,9}))?"
    r"(?P<offset>[Zz]|[+-]\d{2}:\d{2})\Z", re.ASCII)


# --- timestamps ----------------------------------------------------------------


def ms_to_rfc3339(ms: int) -> str:
    """Render epoch milliseconds as RFC 3339 UTC, e.g. ``2026-11-29T10:00:00.123Z``."""
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def rfc3339_to_ms(text: str) -> int:
    """Parse an RFC 3339 timestamp (``Z`` or ``±hh:mm`` offset) to epoch ms.

    Raises:
        ValueError: not RFC 3339 (no offset, a date alone, out of range).
    """
    match = _RFC3339_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError("not an RFC 3339 timestamp")
    offset = "+00:00" if match["offset"] in ("Z", "z") else match["offset"]
    moment = datetime.fromisoformat(f"{match['date']}T{match['time']}{offset}")
    fraction = (match["fraction"] or "") + "000"
    return int(moment.timestamp()) * 1000 + int(fraction[:3])


# --- records -------------------------------------------------------------------


@dataclass(frozen=True)
class ActionRecord:
    """One row of ``actions``. ``*_json`` hold canonical JSON text; times are ms."""

    tenant: str
    action_id: str
    capability_id: str
    crew_id: str
    operation: str
    input_json: str
    input_hash: str
    principal_id: str
    idempotency_key: str | None
    status: str
    dispatch: str
    result_json: str | None
    error_json: str | None
    approval_id: str | None
    timeout_ms: int | None
    chunk_count: int
    created_at: int
    updated_at: int
    #: the host that dispatches or reconciles the running action, and until when (ms): issue 21 item 2
    lease_owner: str | None = None
    lease_expires_at: int | None = None


@dataclass(frozen=True)
class IdempotencyRecord:
    """One idempotency reservation; ``created`` is True for the call that made it."""

    tenant: str
    key: str
    capability_id: str
    action_id: str
    input_hash: str
    created_at: int
    expires_at: int
    created: bool = False


@dataclass(frozen=True)
class ApprovalRecord:
    """One approval. ``status`` is as stored; see :meth:`effective_status`."""

    tenant: str
    approval_id: str
    action_id: str
    capability_id: str
    policy_hash: str
    requested_by: str
    input_snapshot_json: str
    status: str
    decision_reason: str | None
    decided_by: str | None
    decided_at: int | None
    created_at: int
    expires_at: int
    #: JSON proof of a signed decision (:meth:`aip_crewai.httpsig.VerifiedSignature.proof` plus ``body``), else None.
    decision_proof: str | None = None

    def effective_status(self, now_ms: int) -> str:
        """``expired`` for a pending approval past ``expires_at`` (before the sweep ran)."""
        return "expired" if self.status == "pending" and now_ms >= self.expires_at else self.status


@dataclass(frozen=True)
class ApprovalEvent:
    """One row of a tenant's approval event log: position ``seq`` (from 1), the approval, its new status."""

    seq: int
    approval_id: str
    status: str


class ChunkRecord(msgspec.Struct, frozen=True):
    """One stored chunk: its sequence and its compact ``StreamChunk`` JSON (a Struct: a replay page
    builds one per chunk, in C)."""

    sequence: int
    chunk_json: str


@dataclass(frozen=True)
class ApprovalPage:
    """A page of approvals. Follow ``next_cursor`` until ``done`` is True
    (``next_cursor`` is None exactly when ``done``)."""

    items: list[ApprovalRecord]
    next_cursor: str | None
    done: bool


class StoreError(AipError):
    """The host store failed (the root of the store's errors; an outage is :class:`StoreUnavailable`)."""

    code = "store.error"
    category = Category.TEMPORARY
    default_message = "the host store failed"


class StoreUnavailable(StoreError):
    """The database cannot be reached right now: the connection was refused or lost, or no pooled
    connection came free within the pool's timeout (a PostgreSQL store). Temporary: 503, retryable
    (a retried submission with the same idempotency key is answered once). Raised by every store
    method (``Store._run``) for the engine's :attr:`~.store_db.Db.unavailable_errors`."""

    code = "store.unavailable"
    category = Category.TEMPORARY
    http_status = 503
    default_message = "the host store is unavailable; retry shortly"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, retry_after_ms=1000)

    @property
    def retryable(self) -> bool:
        return True


class InsecureStorePath(StoreError):
    code = "store.insecure_path"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the host store path is not safe"


class StoreLocked(AipError):
    """Another host process owns this store (its ``<store>.lock`` is held)."""

    code = "store.locked"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the store is owned by another host process"


class UnusableStore(StoreError):
    """The store file is not SQLite, is damaged, or is another application's database."""

    code = "store.unusable"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the host store file cannot be used"


class MissingTarget(LookupError):
    """:meth:`Store.create_action` found no target action (the run a
    status/events/cancel action names); nothing was written. Internal: the
    action service answers ``action.not_found``."""


class InvalidCursor(AipError):
    code = "request.invalid_cursor"
    category = Category.PERMANENT
    default_message = "the cursor is not valid"


# --- file safety ---------------------------------------------------------------


def check_location(path: Path) -> None:
    """Refuse an unsafe store location (no I/O beyond ``stat``; the shared
    checks of :mod:`aip_crewai.storage`).

    Raises:
        InsecureStorePath: the directory is missing or group/world-writable;
            the file (or its ``-wal``/``-shm``) is a symlink, not a regular
            file, or has any permission bit beyond 0600.
    """
    problem = directory_problem(path.parent, "store directory") or next(
        (p for p in map(lambda c: private_file_problem(c, "store file"), database_files(path)) if p), None)
    if problem is not None:
        raise InsecureStorePath(problem)


def encode_cursor(created_at: int, approval_id: str) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode([created_at, approval_id])).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, approval_id = msgspec.json.decode(raw, type=tuple[int, str])
    except (ValueError, msgspec.DecodeError) as exc:
        raise InvalidCursor() from exc
    return created_at, approval_id


# --- SQL text for the store ----------------------------------------------------


def _columns(record_type: type) -> str:
    return ", ".join(f.name for f in fields(record_type) if f.name != "created")


_ACTION_COLUMNS = _columns(ActionRecord)
_IDEMPOTENCY_COLUMNS = _columns(IdempotencyRecord)
_APPROVAL_COLUMNS = _columns(ApprovalRecord)
_DISPATCH_RANK_SQL = "CASE dispatch WHEN 'not_sent' THEN 0 WHEN 'sent' THEN 1 ELSE 2 END"


def _action_update(tenant: str, action_id: str, *, from_statuses: Iterable[str], status: str, now: int,
                   dispatch: str | None = None, result_json: str | None = None, error_json: str | None = None,
                   approval_id: str | None = None, settle_dispatch: bool = False,
                   replacing: str | None = None) -> tuple[str, tuple[Any, ...]]:
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
    sql = ("UPDATE actions SET status = ?, updated_at = ?, "
           f"dispatch = CASE WHEN CAST(? AS TEXT) IS NOT NULL AND ? > {_DISPATCH_RANK_SQL} THEN CAST(? AS TEXT) "
           "ELSE dispatch END, "
           "result_json = COALESCE(?, result_json), error_json = COALESCE(?, error_json), "
           f"approval_id = COALESCE(?, approval_id) WHERE tenant = ? AND action_id = ? AND status IN ({marks}) "
           f"{'AND result_json = ? ' if replacing is not None else ''}RETURNING {_ACTION_COLUMNS}")
    rank = len(DISPATCH_RANK) if settle_dispatch else DISPATCH_RANK.get(dispatch or "", -1)
    return sql, (target.value, now, dispatch, rank, dispatch, result_json,
                 error_json, approval_id, tenant, action_id, *[s.value for s in sources],
                 *([replacing] if replacing is not None else []))


# --- opening and checking the file ---------------------------------------------


def _connect(path: str) -> sqlite3.Connection:
    """Open the connection (on the worker thread that will own it): WAL,
    ``synchronous=FULL``, foreign keys, a busy timeout, then migrations."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        mode = (conn.execute("PRAGMA journal_mode=WAL").fetchone() or ("",))[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"SQLite refused WAL mode for {path} (got {mode!r})")
        for pragma in ("synchronous=FULL", "foreign_keys=ON", "busy_timeout=10000"):
            conn.execute(f"PRAGMA {pragma}")
        migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def migrate(conn: sqlite3.Connection) -> int:
    """Apply the migrations the database lacks (:func:`aip_crewai.storage.apply_migrations`).

    Returns:
        The resulting ``user_version``.

    Raises:
        StoreError: the database is newer than this code.
    """
    return apply_migrations(conn, MIGRATIONS, too_new=lambda version, known: StoreError(
        f"the store schema is version {version}; this host knows up to {known}"))


# --- PostgreSQL (issue 21) --------------------------------------------------------

def postgres_migration(sqlite_ddl: str) -> str:
    """One migration of :data:`MIGRATIONS` in PostgreSQL's dialect: 64-bit integers (times are ms since
    the epoch) and no ``WITHOUT ROWID``. The migrations are written once for both engines; a test applies
    every one to a real PostgreSQL server."""
    return re.sub(r"\bINTEGER\b", "BIGINT", sqlite_ddl.replace(" WITHOUT ROWID", ""))


#: :data:`MIGRATIONS` for PostgreSQL, tracked in ``aip_schema_version`` (migration N brings it to N).
PG_MIGRATIONS: tuple[str, ...] = tuple(postgres_migration(ddl) for ddl in MIGRATIONS)
#: The advisory lock held while migrating, so hosts starting together migrate once.
_PG_MIGRATION_LOCK = 0x41495044


def is_postgres_url(location: str | Path) -> bool:
    """Whether a ``[host] store`` value names a PostgreSQL database (``postgresql://`` or ``postgres://``)."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def _pg_connect(url: str, application_name: str, error: type[StoreError]) -> Any:
    """An autocommit psycopg connection to ``url``; ``error`` when psycopg is missing or the server
    cannot be reached (its first message line only: libpq never echoes a password, and the URL holds none)."""
    try:
        import psycopg
    except ImportError as exc:
        raise error("a PostgreSQL store needs psycopg: pip install 'aip-crewai[postgresql]'") from exc
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=10, application_name=application_name)
    except psycopg.Error as exc:
        first = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise error(f"cannot connect to the PostgreSQL store ({type(exc).__name__}: {first})") from exc


def connect_postgres(url: str) -> Any:
    """Open an autocommit psycopg connection to ``url`` and apply :data:`PG_MIGRATIONS` (on the worker).

    Raises:
        StoreError: psycopg is not installed, the server refused the connection, or its schema is newer.
    """
    conn = _pg_connect(url, "aip-crewai-host", StoreError)
    try:
        migrate_postgres(conn)
    except BaseException:
        conn.close()
        raise
    return conn


#: Seconds a store call waits for a free pooled connection (or for a new one) before it fails.
PG_POOL_TIMEOUT_S = 10.0


def open_postgres_pool(url: str, size: int) -> Any:
    """Apply :data:`PG_MIGRATIONS` on one connection (:func:`connect_postgres`, then closed), then open a
    ``psycopg_pool.ConnectionPool`` of ``size`` autocommit connections to ``url`` (all opened before this
    returns). A connection is checked out for the whole of one store method (:class:`store_db.PostgresDb`)
    and tried as it leaves the pool: one the server dropped is replaced, not handed out.

    Raises:
        StoreError: psycopg or psycopg_pool is missing, the server cannot be reached, or the schema is
            newer (the pool's connections not ready within :data:`PG_POOL_TIMEOUT_S`).
    """
    connect_postgres(url).close()
    try:
        from psycopg_pool import ConnectionPool, PoolTimeout
    except ImportError as exc:
        raise StoreError("a PostgreSQL store needs psycopg_pool: pip install 'aip-crewai[postgresql]'") from exc
    # check: a connection is tried (an empty query) as it leaves the pool, so one the server dropped
    # (a restart, an idle timeout) is replaced there instead of failing the store method that got it.
    # reconnect_timeout: a lost connection's replacement backs off (doubling) for at most this long, then
    # the next store method starts a fresh attempt: after a long outage no retry waits minutes.
    pool = ConnectionPool(url, min_size=size, max_size=size, open=False, timeout=PG_POOL_TIMEOUT_S,
                          name="aip-crewai-host-store", check=ConnectionPool.check_connection,
                          reconnect_timeout=PG_POOL_TIMEOUT_S,
                          kwargs={"autocommit": True, "connect_timeout": 10, "application_name": "aip-crewai-host"})
    try:
        pool.open(wait=True, timeout=PG_POOL_TIMEOUT_S)
    except PoolTimeout as exc:
        pool.close()
        raise StoreError(f"the PostgreSQL store's {size} pooled connections were not ready within "
                         f"{PG_POOL_TIMEOUT_S:g} s") from exc
    except BaseException:
        pool.close()
        raise
    return pool


#: The class of the session advisory locks that keep one process per host id on a PostgreSQL store.
PG_HOST_ID_LOCK_CLASS = 0x41495045


class PostgresHostLock:
    """This process's claim on ``host_id`` on a PostgreSQL store: a connection holding a session advisory
    lock on it (released when the connection closes, so also when the process dies). Several hosts share
    one store, each under its own id: two processes with one id would share dispatch leases (issue 21
    item 2).

    A database restart ends the session and with it the lock, silently: :meth:`verify` (called
    periodically by the host) notices, reconnects and takes the lock again, and says when another
    process took the id in the meantime (the host then stops: it must not dispatch under a shared id).

    Raises (constructor):
        StoreLocked: another running process uses ``host_id`` on this store.
        UnusableStore: psycopg is missing or the server cannot be reached.
    """

    def __init__(self, url: str, host_id: str) -> None:
        self.url, self.host_id = url, host_id
        conn = self._take()
        if conn is None:
            raise StoreLocked(f"another running host uses host_id {host_id!r} on this PostgreSQL store; "
                              "give each host its own [host] host_id")
        self.conn: Any = conn

    def _take(self) -> Any | None:
        """A new connection holding the lock, or None when another process holds it (UnusableStore: no server)."""
        conn = _pg_connect(self.url, "aip-crewai-host-lock", UnusableStore)
        try:
            row = conn.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))",
                               (PG_HOST_ID_LOCK_CLASS, self.host_id)).fetchone()
        except BaseException:
            conn.close()
            raise
        if not row or not row[0]:
            conn.close()
            return None
        return conn

    def verify(self) -> bool | None:
        """Blocking (run it on a thread). True: this process holds the lock (its connection answers, or it
        broke and the lock was taken again on a new one). False: the connection broke and another process
        holds the id now. None: the server cannot be reached (unknown; try again later). Never raises."""
        import psycopg

        try:
            self.conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            pass
        try:
            self.conn.close()
        except psycopg.Error:
            pass
        try:
            conn = self._take()
        except (StoreError, psycopg.Error):
            return None
        if conn is None:
            return False
        self.conn = conn
        return True

    def close(self) -> None:
        """Release the lock (close its connection)."""
        self.conn.close()


def migrate_postgres(conn: Any) -> int:
    """Apply the PostgreSQL migrations ``conn``'s database lacks, each in its own transaction, under an
    advisory lock (concurrent hosts migrate once). Returns the resulting version.

    Raises:
        StoreError: the database is newer than this code, or holds tables that are not a host store's.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS aip_schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM aip_schema_version").fetchone()
        version = int(row[0]) if row else 0
        if row is None:
            others = conn.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = "
                                  "current_schema() AND table_name IN ('actions', 'approvals', 'chunks')").fetchone()
            if others and int(others[0]):
                raise StoreError("the PostgreSQL database holds tables named like the host store's but no "
                                 "aip_schema_version: give the host its own database")
            conn.execute("INSERT INTO aip_schema_version (version) VALUES (0)")
        if version > len(PG_MIGRATIONS):
            raise StoreError(f"the store schema is version {version}; this host knows up to {len(PG_MIGRATIONS)}")
        for number in range(version + 1, len(PG_MIGRATIONS) + 1):
            conn.execute(PG_MIGRATIONS[number - 1])
            conn.execute("UPDATE aip_schema_version SET version = %s", (number,))
        return len(PG_MIGRATIONS) if version < len(PG_MIGRATIONS) else version


def check_store_file(path: Path) -> None:
    """Refuse, before serving, a store file that cannot be this host's store
    (read-only: nothing is written, so an operator's file is never touched).

    An absent or empty file is fine (a new store). Otherwise the file must
    be SQLite, pass ``quick_check``, and either be empty at schema version 0
    or hold the ``actions`` table: migrating another application's database
    would add our tables to its data.

    Raises:
        UnusableStore: with a message naming the file and what to do.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    advice = "point host.store at a new path, or restore the store from a backup"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise UnusableStore(f"store file {path} cannot be opened ({exc}); {advice}") from exc
    try:
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
        except sqlite3.DatabaseError as exc:
            raise UnusableStore(f"store file {path} is not a SQLite database ({exc}); {advice}") from exc
        problems = integrity_problems(conn, 3)
        if problems:
            text = " ".join(" ".join(problems).replace("*** in database main ***", "").split())[:200]
            raise UnusableStore(f"store file {path} is corrupt (SQLite integrity check: {text}); {advice}")
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'").fetchall()}
        if (version == 0 and tables) or (version > 0 and "actions" not in tables):
            shown = ", ".join(sorted(tables)[:5]) or "none"
            raise UnusableStore(f"store file {path} is not an aip-crewai host store (schema version {version}, "
                                f"tables: {shown}); {advice}")
    finally:
        conn.close()
