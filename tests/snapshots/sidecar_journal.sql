-- user_version = 6
-- application_id = 1095323715

-- index jobs_unfinished (on jobs)
CREATE INDEX jobs_unfinished ON jobs(status) WHERE status IN ('queued', 'running');

-- index task_runs_action (on task_runs)
CREATE INDEX task_runs_action ON task_runs(action_id);

-- index task_runs_lookup (on task_runs)
CREATE INDEX task_runs_lookup ON task_runs(task_id, tenant, crew_id);

-- table events (on events)
CREATE TABLE events (
        action_id TEXT NOT NULL,
        sequence INTEGER NOT NULL,
        event TEXT NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (action_id, sequence)
    );

-- table jobs (on jobs)
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
    , imported INTEGER NOT NULL DEFAULT 0);

-- table run_state (on run_state)
CREATE TABLE run_state (
        action_id TEXT NOT NULL,
        result_index INTEGER NOT NULL,
        state BLOB NOT NULL,
        PRIMARY KEY (action_id, result_index)
    );

-- table task_runs (on task_runs)
CREATE TABLE task_runs (
        task_id TEXT NOT NULL,
        action_id TEXT NOT NULL,
        crew_id TEXT NOT NULL,
        result_index INTEGER, tenant TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (task_id, action_id)
    );
