-- user_version = 9
-- application_id = 0

-- index action_usage_by_time (on action_usage)
CREATE INDEX action_usage_by_time ON action_usage (tenant, finished_at);

-- index actions_live (on actions)
CREATE INDEX actions_live ON actions (status, created_at) WHERE status IN ('pending_approval', 'running');

-- index approvals_by_action (on approvals)
CREATE INDEX approvals_by_action ON approvals (tenant, action_id);

-- index approvals_by_created (on approvals)
CREATE INDEX approvals_by_created ON approvals (tenant, created_at, approval_id);

-- index approvals_pending_expiry (on approvals)
CREATE INDEX approvals_pending_expiry ON approvals (expires_at) WHERE status = 'pending';

-- index message_ids_expiry (on message_ids)
CREATE INDEX message_ids_expiry ON message_ids (expires_at);

-- index receipts_by_action (on receipts)
CREATE INDEX receipts_by_action ON receipts (tenant, action_id);

-- index webhook_deliveries_by_created (on webhook_deliveries)
CREATE INDEX webhook_deliveries_by_created ON webhook_deliveries (tenant, created_at, delivery_id);

-- index webhook_deliveries_due (on webhook_deliveries)
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';

-- index webhook_deliveries_order (on webhook_deliveries)
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (tenant, endpoint_id, action_id, seq);

-- table action_usage (on action_usage)
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

-- table actions (on actions)
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
    updated_at      INTEGER NOT NULL, lease_owner TEXT, lease_expires_at INTEGER, trace_parent TEXT, lease_epoch INTEGER NOT NULL DEFAULT 0, sidecar TEXT,
    PRIMARY KEY (tenant, action_id)
) WITHOUT ROWID;

-- table approval_events (on approval_events)
CREATE TABLE approval_events (
    tenant      TEXT NOT NULL,
    seq         INTEGER NOT NULL CHECK (seq >= 1),
    approval_id TEXT NOT NULL,
    status      TEXT NOT NULL,
    PRIMARY KEY (tenant, seq)
) WITHOUT ROWID;

-- table approvals (on approvals)
CREATE TABLE "approvals" (
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
    expires_at          INTEGER NOT NULL, decision_proof TEXT,
    PRIMARY KEY (tenant, approval_id),
    FOREIGN KEY (tenant, action_id) REFERENCES actions (tenant, action_id)
) WITHOUT ROWID;

-- table chunks (on chunks)
CREATE TABLE chunks (
    tenant     TEXT NOT NULL,
    action_id  TEXT NOT NULL,
    sequence   INTEGER NOT NULL CHECK (sequence >= 0),
    chunk_json TEXT NOT NULL,
    PRIMARY KEY (tenant, action_id, sequence),
    FOREIGN KEY (tenant, action_id) REFERENCES actions (tenant, action_id)
) WITHOUT ROWID;

-- table idempotency (on idempotency)
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

-- table message_ids (on message_ids)
CREATE TABLE message_ids (
    tenant     TEXT NOT NULL,
    message_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, message_id)
) WITHOUT ROWID;

-- table receipts (on receipts)
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

-- table webhook_attempts (on webhook_attempts)
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

-- table webhook_deliveries (on webhook_deliveries)
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
