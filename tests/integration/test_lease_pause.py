"""A lease holder paused past its lease writes nothing after it (issue: fencing tokens), with real processes.

Three host processes (``host-0`` .. ``host-2``, 1-second dispatch leases, small store bounds) share one real
PostgreSQL database (tests/pgserver.py) and one real sidecar running the offline ``slow`` crew (about 6 s,
20 chunks). Each round, the host holding a running action's lease is stopped with SIGSTOP for at least three
leases; another host takes the lease over (a tenant's read there settles it) and finishes the action; the
paused host is then resumed (SIGCONT). Every write to the store is recorded by triggers in the database with
the session's host (each host's URL sets ``aip.host``), so the test checks what the database got, not what a
host says: the action ends once, written by the new holder; its chunks are stored once each, in order, ending
with ``done``; the crew ran once; and once another host took the lease, no row was inserted or changed by the
paused host (which logs ``lease_lost``). The second test adds a database outage during the takeover (the
whole PostgreSQL cluster SIGSTOPped): the same holds, and ``/ready`` of the running hosts is 503 within the
store call bound while the database does not answer and 200 again after.

docs/operating.md "Faults and their bounds". Skipped with one line without PostgreSQL.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

import httpx2
import pgserver
import pytest
import storebackend
from kits.host import Host, start_host
from kits.poll import until

from aip_crewai.client import new_id

psycopg = pytest.importorskip("psycopg", reason="PostgreSQL tests skipped: psycopg is not installed")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.host_processes,
    storebackend.only_in_postgresql_pass,  # its hosts are on PostgreSQL whatever the switch says
]

LEASE_S = 1
#: The store's bounds in these hosts: statement 1 s, lock 0.5 s, idle transaction 1 s; a call's bound is 2 s.
STORE_OPTIONS = {
    "store_statement_timeout_ms": 1000,
    "store_lock_timeout_ms": 500,
    "store_idle_in_transaction_timeout_ms": 1000,
}
CALL_BOUND_S = 2.0
#: What a slow, shared machine may add to a bound (scheduling, not waiting): generous on purpose.
SLACK_S = 10.0
HOSTS = ("host-0", "host-1", "host-2")
TERMINAL = ("completed", "failed", "cancelled")

#: Every row inserted or changed in the tables a leased action's writes touch, with the writing session's
#: host (``aip.host``, set by each host's store URL) and the action's lease as the writer's transaction saw it.
WRITE_LOG = """
CREATE TABLE write_log (
    id BIGSERIAL PRIMARY KEY, writer TEXT, tbl TEXT NOT NULL, action_id TEXT, seq BIGINT,
    old_status TEXT, new_status TEXT, old_owner TEXT, new_owner TEXT, old_epoch BIGINT, new_epoch BIGINT
);
CREATE FUNCTION log_chunk() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO write_log (writer, tbl, action_id, seq, new_status, new_owner, new_epoch)
    SELECT current_setting('aip.host', true), 'chunks', NEW.action_id, NEW.sequence, a.status, a.lease_owner,
           a.lease_epoch
    FROM actions a WHERE a.tenant = NEW.tenant AND a.action_id = NEW.action_id;
    RETURN NULL;
END $$;
CREATE FUNCTION log_action() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO write_log (writer, tbl, action_id, old_status, new_status, old_owner, new_owner, old_epoch,
                           new_epoch)
    VALUES (current_setting('aip.host', true), 'actions', NEW.action_id, OLD.status, NEW.status, OLD.lease_owner,
            NEW.lease_owner, OLD.lease_epoch, NEW.lease_epoch);
    RETURN NULL;
END $$;
CREATE FUNCTION log_ledger() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO write_log (writer, tbl, action_id) VALUES (current_setting('aip.host', true), TG_TABLE_NAME,
                                                           NEW.action_id);
    RETURN NULL;
END $$;
CREATE TRIGGER chunk_written AFTER INSERT ON chunks FOR EACH ROW EXECUTE FUNCTION log_chunk();
CREATE TRIGGER action_written AFTER UPDATE ON actions FOR EACH ROW
    WHEN (OLD.* IS DISTINCT FROM NEW.*) EXECUTE FUNCTION log_action();
CREATE TRIGGER usage_written AFTER INSERT OR UPDATE ON action_usage FOR EACH ROW EXECUTE FUNCTION log_ledger();
CREATE TRIGGER receipt_written AFTER INSERT ON receipts FOR EACH ROW EXECUTE FUNCTION log_ledger();
"""


@dataclass
class Write:
    """One row of ``write_log``."""

    id: int
    writer: str | None
    tbl: str
    action_id: str | None
    seq: int | None
    old_status: str | None
    new_status: str | None
    old_owner: str | None
    new_owner: str | None
    old_epoch: int | None
    new_epoch: int | None


@dataclass
class Cluster:
    """Three hosts, their sidecar and the database they share."""

    hosts: dict[str, Host]
    sidecar: object
    url: str
    server: pgserver.PostgresServer

    def writes(self, action_id: str) -> list[Write]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute("SELECT * FROM write_log WHERE action_id = %s ORDER BY id", (action_id,)).fetchall()
        return [Write(*row) for row in rows]

    def lease(self, action_id: str) -> tuple[str, str | None, int]:
        """``(status, lease_owner, lease_epoch)`` of the action as stored."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT status, lease_owner, lease_epoch FROM actions WHERE tenant = 'acme' AND action_id = %s",
                (action_id,),
            ).fetchone()
        assert row is not None, action_id
        return row[0], row[1], int(row[2])

    def chunk_count(self, action_id: str) -> int:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM chunks WHERE tenant = 'acme' AND action_id = %s", (action_id,)
            ).fetchone()
        return int(row[0]) if row else 0


@pytest.fixture
def cluster(sidecar_factory, tmp_path, postgres_server, postgres_url) -> Iterator[Cluster]:
    sidecar = sidecar_factory.start()
    hosts: dict[str, Host] = {}
    try:
        for name in HOSTS:  # each host's sessions say who they are (aip.host), for the write log's triggers
            url = f"{postgres_url}?options={quote(f'-c aip.host={name}')}"
            hosts[name] = start_host(
                tmp_path / name,
                sidecar.base_url,
                sidecar.token,
                store=url,
                host_options={"host_id": name, "lease_seconds": LEASE_S, **STORE_OPTIONS},
            )
        with psycopg.connect(postgres_url, autocommit=True) as conn:  # the schema exists once a host is ready
            conn.execute(WRITE_LOG)
        yield Cluster(hosts, sidecar, postgres_url, postgres_server)
    finally:
        for host in hosts.values():
            host.process.send_signal(signal.SIGCONT)
            host.stop(signal.SIGKILL)


def _executions(sidecar, action_id: str) -> int:
    """Model calls made for one action (two per run of the slow crew: two tasks)."""
    return sum(1 for line in sidecar.calls() if line.split()[3].endswith(action_id))


def _lease_lost_logged(host: Host, action_id: str) -> bool:
    for line in host.log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            if "lease_lost" in line and action_id in line:
                return True
            continue
        if entry.get("event") == "lease_lost" and entry.get("action_id") == action_id:
            return True
    return False


def _start_run(cluster: Cluster, holder: str) -> str:
    """A slow run submitted on another host and approved on ``holder``, which dispatches it; returns its id
    once its first chunks are stored."""
    action_id = new_id("act")
    submitter = cluster.hosts[next(n for n in HOSTS if n != holder)]
    with submitter.client("acme-app") as app, cluster.hosts[holder].client("acme-approver") as approver:
        pending = app.call("cap:crewai:slow", {"topic": "tides"}, action_id=action_id, idempotency_key=new_id("k"))
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "pause test")
    until(lambda: cluster.chunk_count(action_id) >= 2, timeout=120, interval=0.05, what="the run to stream")
    status, owner, _ = cluster.lease(action_id)
    assert (status, owner) == ("running", holder)
    return action_id


def _taken_over(cluster: Cluster, action_id: str, paused: str) -> str:
    """Poll (reading the action on the running hosts, which settles an expired lease) until another host
    holds the action's lease; returns that host."""

    def taken() -> str | None:
        for name, host in cluster.hosts.items():
            if name != paused:
                with host.client("acme-app") as app:
                    app.action(action_id)
        status, owner, _ = cluster.lease(action_id)
        return owner if owner not in (None, paused) else None

    return until(taken, timeout=120, interval=0.1, what="another host to take the lease")


def _ended(cluster: Cluster, action_id: str, by: str) -> dict:
    """Poll until the action ended (read on ``by``); returns its stored result."""
    with cluster.hosts[by].client("acme-app") as app:
        until(lambda: cluster.lease(action_id)[0] in TERMINAL, timeout=120, interval=0.1, what="the action to end")
        return app.result(action_id)["body"]["action_result"]


def _check_round(cluster: Cluster, action_id: str, paused: str, new_holder: str, result: dict) -> None:
    """What the database got for one paused round (see the module docstring)."""
    assert result["status"] == "completed", result
    assert "tides" in result["output"]["raw"]
    writes = cluster.writes(action_id)
    takeover = next(w for w in writes if w.tbl == "actions" and w.old_owner == paused and w.new_owner != paused)
    late = [w for w in writes if w.writer == paused and w.id > takeover.id]
    assert not late, f"{paused} wrote after losing its lease: {late}"
    for w in writes:  # every chunk was inserted by the host holding the lease at that moment
        if w.tbl == "chunks":
            assert w.writer == w.new_owner, w
    ends = [w for w in writes if w.tbl == "actions" and w.old_status == "running" and w.new_status in TERMINAL]
    assert len(ends) == 1 and ends[0].writer == new_holder and ends[0].new_status == "completed", ends
    sequences = [w.seq or 0 for w in writes if w.tbl == "chunks"]
    assert sorted(sequences) == list(range(len(sequences))), sequences  # each once, none missing
    with cluster.hosts[new_holder].client("acme-app") as app:
        events = list(app.follow(action_id))
    chunks = [e["body"]["stream_chunk"] for name, e in events if name in ("chunk", "done")]
    assert [c["sequence"] for c in chunks] == list(range(len(sequences)))  # stored in order
    assert chunks[-1]["kind"] == "done" and events[-1][0] == "result"
    assert events[-1][1]["body"]["action_result"] == result
    assert _executions(cluster.sidecar, action_id) == 2  # the crew ran once


def _paused_round(cluster: Cluster, holder: str, *, resume_early: bool) -> None:
    """One round: ``holder`` dispatches a run and is stopped; another host takes it over; ``holder`` resumes
    (``resume_early``: as soon as the lease is taken, while the new holder still runs it; else once it ended)."""
    action_id = _start_run(cluster, holder)
    host = cluster.hosts[holder]
    stopped_at = time.monotonic()
    host.process.send_signal(signal.SIGSTOP)
    try:
        new_holder = _taken_over(cluster, action_id, holder)
        if not resume_early:
            result = _ended(cluster, action_id, new_holder)
        until(lambda: time.monotonic() - stopped_at >= 3 * LEASE_S, what="three leases")
    finally:
        host.process.send_signal(signal.SIGCONT)
    until(lambda: _lease_lost_logged(host, action_id), timeout=60, what=f"{holder} to log lease_lost")
    if resume_early:
        result = _ended(cluster, action_id, new_holder)
    _check_round(cluster, action_id, holder, new_holder, result)


def test_a_lease_holder_paused_past_its_lease_and_resumed_writes_nothing(cluster: Cluster) -> None:
    for n, resume_early in enumerate((False, True, False, True)):
        _paused_round(cluster, HOSTS[n % len(HOSTS)], resume_early=resume_early)


# --- two faults at once: the pause and a database outage during the takeover ----------------------------


def _ready_status(host: Host) -> int:
    try:
        return httpx2.get(f"{host.base_url}/ready", timeout=CALL_BOUND_S + SLACK_S).status_code
    except httpx2.TransportError:
        return 0


def test_a_paused_holder_and_a_database_outage_during_the_takeover(cluster: Cluster) -> None:
    for n in range(2):
        holder = HOSTS[n % len(HOSTS)]
        others = [cluster.hosts[name] for name in HOSTS if name != holder]
        action_id = _start_run(cluster, holder)
        host = cluster.hosts[holder]
        stopped_at = time.monotonic()
        host.process.send_signal(signal.SIGSTOP)
        try:
            with pgserver.stopped(cluster.server):
                down_at = time.monotonic()
                for other in others:  # 503 within the call bound while the store does not answer
                    until(lambda o=other: _ready_status(o) == 503, timeout=CALL_BOUND_S + SLACK_S, what="/ready 503")
                assert time.monotonic() - down_at < CALL_BOUND_S + SLACK_S
                until(lambda: time.monotonic() - down_at >= 3 * LEASE_S, what="an outage of three leases")
            for other in others:
                until(lambda o=other: _ready_status(o) == 200, timeout=60, what="/ready 200 after the outage")
            new_holder = _taken_over(cluster, action_id, holder)
            result = _ended(cluster, action_id, new_holder)
            until(lambda: time.monotonic() - stopped_at >= 3 * LEASE_S, what="three leases")
        finally:
            host.process.send_signal(signal.SIGCONT)
        until(lambda: _lease_lost_logged(host, action_id), timeout=60, what=f"{holder} to log lease_lost")
        until(lambda: _ready_status(host) == 200, timeout=60, what=f"{holder} /ready 200 after SIGCONT")
        _check_round(cluster, action_id, holder, new_holder, result)
