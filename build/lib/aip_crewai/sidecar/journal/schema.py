"""The journal's schema as data (no SQL is executed here; :mod:`.files` runs it).

Forward-only numbered migrations (index + 1 is the ``PRAGMA user_version``
after applying one; never edit a shipped migration, append a new one) and
the marks that tell an aip-crewai journal from any other SQLite file.

Source: ARCHITECTURE.md §5 (tables, forward-only migrations), ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

#: ``PRAGMA application_id`` of a journal (ASCII "AIPC", 1095323715), set by migration 3.
APPLICATION_ID = 0x41495043
#: Tables every journal at schema version >= 1 has.
OWN_TABLES = frozenset({"jobs", "events"})

#: Forward-only migrations; index + 1 is the ``user_version`` after applying it.
MIGRATIONS: tuple[str, ...] = (
    # 1: jobs and their events
    """
    CREATE TABLE jobs (
        action_id TEXT PRIMARY KEY,
        crew_id TEXT NOT NULL,
        operation TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        timeout_ms INTEGER,
        status TEXT NOT NULL,
        event_count INTEGER NOT NULL DEFAULT 0,
        output BLOB,
        error BLOB,
        dropped_events INTEGER NOT NULL DEFAULT 0,
        provider_stop_observed INTEGER,
        archived INTEGER NOT NULL DEFAULT 0,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    );
    CREATE INDEX jobs_unfinished ON jobs(status) WHERE status IN ('queued', 'running');
    CREATE TABLE events (
        action_id TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        event TEXT NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (action_id, sequence)
    );
    """,
    # 2: task index for replay admission
    """
    CREATE TABLE task_runs (
        task_id TEXT NOT NULL,
        action_id TEXT NOT NULL,
        crew_id TEXT NOT NULL,
        result_index INTEGER,
        PRIMARY KEY (task_id, action_id)
    );
    CREATE INDEX task_runs_action ON task_runs(action_id);
    """,
    # 3: mark the file as an aip-crewai journal (SQLite header field, see APPLICATION_ID)
    f"PRAGMA application_id = {APPLICATION_ID};",
    # 4: the replay index is per tenant (docs/security.md "Tenant-scoped crew state"); rows written before
    # this migration get the tenant their job id names (see tenancy.tenant_of; an id whose
    # prefix is no tenant name gets a tenant no job carries, so it is never matched again)
    """
    ALTER TABLE task_runs ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
    UPDATE task_runs SET tenant = substr(action_id, 1, instr(action_id, ':') - 1)
        WHERE instr(action_id, ':') > 1;
    CREATE INDEX task_runs_lookup ON task_runs(task_id, tenant, crew_id);
    """,
    # 5: per completed run (result_index -1) or batch item, the crew fingerprint a replay checks
    # (never crew inputs); same retention as the job (deleted on archive)
    """
    CREATE TABLE run_state (
        action_id TEXT NOT NULL,
        result_index INTEGER NOT NULL,
        state BLOB NOT NULL,
        PRIMARY KEY (action_id, result_index)
    );
    """,
    # 6: jobs imported from a reference journal are marked (their view says so; an admission naming
    # one is refused: docs/operating.md "Migrating from the reference sidecar"); rows written before are not
    "ALTER TABLE jobs ADD COLUMN imported INTEGER NOT NULL DEFAULT 0;",
)
