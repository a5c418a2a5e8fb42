"""The host store's schema: forward-only numbered migrations, written once for both engines.

Migration N (1-based) of :data:`MIGRATIONS` brings SQLite's ``PRAGMA user_version`` to N; PostgreSQL
applies the same list in its dialect (:func:`postgres_migration`), tracked in ``aip_schema_version``.
Every table's primary key starts with ``tenant``. Never edit a shipped migration, append a new one.

Source: ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from ...plumbing.storage import apply_migrations
from .records import StoreError

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


# Migration 3: the dispatch lease of a running action: which host dispatches or
# reconciles it, until when (ms). A lease that is not renewed expires, and another host takes it over.
_MIGRATION_3 = """
ALTER TABLE actions ADD COLUMN lease_owner TEXT;
ALTER TABLE actions ADD COLUMN lease_expires_at INTEGER;
"""


# Migration 4: the proof of a signed decision (JSON: the RFC 9421 signature
# base, signature and the decision body, docs/approvals.md "Signed requests"), and the approval
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


# Migration 5: what a final result leaves besides itself (docs/observing.md "Observing actions"): the usage of a
# crew operation (token counts, latency ms, cost in picos = 10^-12 of ``currency``; one row per action,
# replaced with its result) and the signed receipt of a final result (its canonical JSON document, one
# per action, never changed). Both are written by the store in the result's own transaction.
_MIGRATION_5 = """
CREATE TABLE action_usage (
    tenant            TEXT NOT NULL,
    action_id         TEXT NOT NULL,
    crew_id           TEXT NOT NULL,
    operation         TEXT NOT NULL,
    finished_at       INTEGER NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    total_tokens      INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    requests          INTEGER NOT NULL,
    latency_ms        INTEGER NOT NULL,
    cost_picos        INTEGER,
    currency          TEXT,
    PRIMARY KEY (tenant, action_id)
) WITHOUT ROWID;
CREATE INDEX action_usage_by_time ON action_usage (tenant, finished_at);
CREATE TABLE receipts (
    tenant       TEXT NOT NULL,
    receipt_id   TEXT NOT NULL,
    action_id    TEXT NOT NULL,
    approval_id  TEXT,
    hash         TEXT NOT NULL,
    document     TEXT NOT NULL,
    created_at   INTEGER NOT NULL,
    PRIMARY KEY (tenant, receipt_id)
) WITHOUT ROWID;
CREATE INDEX receipts_by_action ON receipts (tenant, action_id);
"""


# Migration 6: the W3C trace context an action was created in (``traceparent``, or NULL), which its
# dispatch continues, on whichever host dispatches it (docs/observing.md "Observing actions": traces).
_MIGRATION_6 = """
ALTER TABLE actions ADD COLUMN trace_parent TEXT;
"""


# Migration 7: the fencing token of a dispatch lease: raised each time another host takes the lease;
# every write a lease holder makes on behalf of the action is conditional on it (ARCHITECTURE.md §10).
_MIGRATION_7 = """
ALTER TABLE actions ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0;
"""


# Migration 8: an action's placement: the name of the ``[[sidecars]]`` entry its job was (or is about to be)
# sent to, recorded before the start is sent; every follow-up (status, events, cancel, reconciliation)
# goes there (docs/operating.md "Several sidecars"). NULL: nothing was sent yet (placed when it is); '' (the rows
# this migration finds sent): sent before placements existed, to the crew's first configured sidecar.
_MIGRATION_8 = """
ALTER TABLE actions ADD COLUMN sidecar TEXT;
UPDATE actions SET sidecar = '' WHERE dispatch <> 'not_sent';
"""


# Migration 9: the webhook outbox (docs/webhooks.md). One row per (event, endpoint), written by the store in
# the state change's own transaction; ``seq`` orders one endpoint's events of one action; a host claims a due
# row until ``claim_expires_at`` (the database's clock), records one attempt, and releases it. Attempts are
# kept for the operators' deliveries list.
_MIGRATION_9 = """
CREATE TABLE webhook_deliveries (
    tenant           TEXT NOT NULL,
    delivery_id      TEXT NOT NULL,
    endpoint_id      TEXT NOT NULL,
    event_type       TEXT NOT NULL,
    action_id        TEXT NOT NULL,
    seq              INTEGER NOT NULL,
    body             TEXT NOT NULL,
    status           TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'expired')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    created_at       INTEGER NOT NULL,
    deadline_at      INTEGER NOT NULL,
    next_attempt_at  INTEGER NOT NULL,
    claimed_by       TEXT,
    claim_expires_at INTEGER,
    finished_at      INTEGER,
    last_outcome     TEXT,
    PRIMARY KEY (tenant, delivery_id)
) WITHOUT ROWID;
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (tenant, endpoint_id, action_id, seq);
CREATE INDEX webhook_deliveries_by_created ON webhook_deliveries (tenant, created_at, delivery_id);
CREATE TABLE webhook_attempts (
    tenant       TEXT NOT NULL,
    delivery_id  TEXT NOT NULL,
    attempt      INTEGER NOT NULL,
    host_id      TEXT NOT NULL,
    started_at   INTEGER NOT NULL,
    duration_ms  INTEGER NOT NULL,
    outcome      TEXT NOT NULL,
    status_code  INTEGER,
    PRIMARY KEY (tenant, delivery_id, attempt),
    FOREIGN KEY (tenant, delivery_id) REFERENCES webhook_deliveries (tenant, delivery_id)
) WITHOUT ROWID;
"""


#: Forward-only migrations; migration N (1-based) brings ``user_version`` to N.
MIGRATIONS: tuple[str, ...] = (
    _MIGRATION_1,
    _MIGRATION_2,
    _MIGRATION_3,
    _MIGRATION_4,
    _MIGRATION_5,
    _MIGRATION_6,
    _MIGRATION_7,
    _MIGRATION_8,
    _MIGRATION_9,
)


def migrate(conn: sqlite3.Connection) -> int:
    """Apply the migrations the database lacks (:func:`aip_crewai.plumbing.storage.apply_migrations`).

    Returns:
        The resulting ``user_version``.

    Raises:
        StoreError: the database is newer than this code.
    """
    return apply_migrations(
        conn,
        MIGRATIONS,
        too_new=lambda version, known: StoreError(
            f"the store schema is version {version}; this host knows up to {known}"
        ),
    )


def postgres_migration(sqlite_ddl: str) -> str:
    """One migration of :data:`MIGRATIONS` in PostgreSQL's dialect: 64-bit integers (times are ms since
    the epoch) and no ``WITHOUT ROWID``. The migrations are written once for both engines; a test applies
    every one to a real PostgreSQL server."""
    return re.sub(r"\bINTEGER\b", "BIGINT", sqlite_ddl.replace(" WITHOUT ROWID", ""))


#: :data:`MIGRATIONS` for PostgreSQL, tracked in ``aip_schema_version`` (migration N brings it to N).
PG_MIGRATIONS: tuple[str, ...] = tuple(postgres_migration(ddl) for ddl in MIGRATIONS)


#: The advisory lock held while migrating, so hosts starting together migrate once.
_PG_MIGRATION_LOCK = 0x41495044


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
            others = conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = "
                "current_schema() AND table_name IN ('actions', 'approvals', 'chunks')"
            ).fetchone()
            if others and int(others[0]):
                raise StoreError(
                    "the PostgreSQL database holds tables named like the host store's but no "
                    "aip_schema_version: give the host its own database"
                )
            conn.execute("INSERT INTO aip_schema_version (version) VALUES (0)")
        if version > len(PG_MIGRATIONS):
            raise StoreError(f"the store schema is version {version}; this host knows up to {len(PG_MIGRATIONS)}")
        for number in range(version + 1, len(PG_MIGRATIONS) + 1):
            conn.execute(PG_MIGRATIONS[number - 1])
            conn.execute("UPDATE aip_schema_version SET version = %s", (number,))
        return len(PG_MIGRATIONS) if version < len(PG_MIGRATIONS) else version
