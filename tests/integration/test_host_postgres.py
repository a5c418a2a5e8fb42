"""The real host on a real PostgreSQL store: the governed flow end to end, the
store's rows in PostgreSQL, a restart on the same database, and a second host refused while the first owns it
(each host id is held by one process, also after a database restart dropped its lock). Skipped with one
line without PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import storebackend
from kits.host import free_port, start_host, write_config
from kits.poll import until

from aip_crewai.client import new_id
from aip_crewai.host.store.engines.postgres import PG_HOST_ID_LOCK_CLASS, PostgresHostLock
from aip_crewai.host.store.records import StoreLocked

psycopg = pytest.importorskip("psycopg", reason="PostgreSQL tests skipped: psycopg is not installed")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.host_processes,
    storebackend.only_in_postgresql_pass,  # its hosts are on PostgreSQL whatever the switch says
]


def governed_run(host, topic: str) -> dict:
    with host.client("acme-app") as app, host.client("acme-approver") as approver:
        action_id, key = new_id("act"), new_id("key")
        pending = app.call("cap:crewai:echo", {"topic": topic}, action_id=action_id, idempotency_key=key)
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "postgres test")
        events = list(app.follow(action_id))
        again = app.call("cap:crewai:echo", {"topic": topic}, action_id=action_id, idempotency_key=key)
    assert events[-1][0] == "result"
    assert again["body"]["action_result"]["status"] == "completed"
    return {"action_id": action_id, "result": events[-1][1]["body"]["action_result"]}


def test_the_governed_flow_on_postgresql_survives_a_restart(sidecar_factory, tmp_path, postgres_url):
    sidecar = sidecar_factory.start()
    host = start_host(tmp_path / "host", sidecar.base_url, sidecar.token, store=postgres_url)
    try:
        first = governed_run(host, "harbours")
        assert first["result"]["status"] == "completed" and "harbours" in first["result"]["output"]["raw"]
        with psycopg.connect(postgres_url) as conn:
            row = conn.execute(
                "SELECT status, dispatch FROM actions WHERE action_id = %s", (first["action_id"],)
            ).fetchone()
            chunks = conn.execute("SELECT count(*) FROM chunks WHERE action_id = %s", (first["action_id"],)).fetchone()
        assert row == ("completed", "acknowledged") and chunks[0] > 0
    finally:
        assert host.stop() == 0
    again = start_host(tmp_path / "host2", sidecar.base_url, sidecar.token, store=postgres_url)
    try:
        with again.client("acme-app") as app:
            assert app.result(first["action_id"])["body"]["action_result"]["status"] == "completed"
        assert governed_run(again, "estuaries")["result"]["status"] == "completed"
    finally:
        again.stop()


def test_a_second_process_with_the_same_host_id_is_refused(sidecar_factory, tmp_path, postgres_url):
    sidecar = sidecar_factory.start()
    host = start_host(
        tmp_path / "host", sidecar.base_url, sidecar.token, store=postgres_url, host_options={"host_id": "host-a"}
    )
    try:
        config = write_config(
            tmp_path / "second",
            sidecar.base_url,
            sidecar.token,
            free_port(),
            store=postgres_url,
            host_options={"host_id": "host-a"},
        )
        second = subprocess.run(
            [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert second.returncode == 2, second.stderr
        assert "another running host uses host_id 'host-a'" in second.stderr
    finally:
        host.stop()


def test_a_password_in_the_url_is_refused_before_anything_connects(tmp_path):
    config = write_config(
        tmp_path / "host", "http://127.0.0.1:9", "tok", free_port(), store="postgresql://aip:secret@127.0.0.1:5/db"
    )
    run = subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 2 and "PGPASSFILE" in run.stderr and "secret" not in run.stderr


def _drop_host_locks(url: str) -> None:
    """End the sessions holding host-id locks, as a database restart does; return once they are gone."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'aip-crewai-host-lock' AND datname = current_database()"
        )
        until(
            lambda: (
                not conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'aip-crewai-host-lock' "
                    "AND datname = current_database()"
                ).fetchone()[0]
            ),
            timeout=30,
            interval=0.01,
            what="the terminated sessions ended",
        )


def test_a_dropped_host_id_lock_is_taken_again_or_reported_taken(postgres_url):
    """A database restart ends the lock's session silently: verify() takes the lock again on a new
    connection, or says another process took the id meanwhile, or that the server is unreachable."""
    lock = PostgresHostLock(postgres_url, "host-a")
    try:
        assert lock.verify() is True
        _drop_host_locks(postgres_url)
        assert lock.verify() is True  # reconnected and locked again: a second claimant is refused
        with pytest.raises(StoreLocked):
            PostgresHostLock(postgres_url, "host-a")
        _drop_host_locks(postgres_url)
        other = PostgresHostLock(postgres_url, "host-a")  # the id was free: another process took it
        try:
            assert lock.verify() is False
        finally:
            other.close()
        _drop_host_locks(postgres_url)
        lock.url = "postgresql://127.0.0.1:1/nowhere"  # the server is gone: unknown, never raised
        assert lock.verify() is None
    finally:
        lock.close()


def test_a_host_whose_id_another_process_took_stops(sidecar_factory, tmp_path, postgres_url):
    """After the database dropped host-a's lock, another process claims host-a first: the running host
    notices within a third of its lease, logs host_id_taken and exits 1 (never dispatching under a shared id)."""
    sidecar = sidecar_factory.start()
    host = start_host(
        tmp_path / "host",
        sidecar.base_url,
        sidecar.token,
        store=postgres_url,
        host_options={"host_id": "host-a", "lease_seconds": 1},
    )
    usurper = psycopg.connect(postgres_url, autocommit=True)
    try:
        # The usurper queues for host-a's lock first, so it gets it when the session ends, before the
        # host's next check can take it again.
        queued = threading.Thread(
            target=usurper.execute,
            args=("SELECT pg_advisory_lock(%s, hashtext(%s))", (PG_HOST_ID_LOCK_CLASS, "host-a")),
        )
        queued.start()
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            until(
                lambda: admin.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone()[0],
                timeout=30,
                interval=0.01,
                what="the usurper queued",
            )
        _drop_host_locks(postgres_url)
        queued.join(timeout=10)
        assert host.process.wait(timeout=30) == 1
        assert "host_id_taken" in host.log.read_text()
    finally:
        usurper.close()
        host.stop()


def test_the_suites_postgresql_switch_gives_each_host_its_own_database_kept_across_a_kill9(
    sidecar_factory, tmp_path, postgres_server, monkeypatch
):
    """``AIP_CREWAI_TEST_STORE=postgresql`` (tests/storebackend.py): a host started without an explicit store
    gets a database of its own and a stable host_id; a restart on the same workdir after kill -9 takes the
    host_id over at once (the session advisory lock died with the process) and finds its actions."""
    import signal

    import storebackend

    monkeypatch.setenv(storebackend.SWITCH, "postgresql")
    sidecar = sidecar_factory.start()
    first_store, first_id = storebackend.host_store(tmp_path / "one")
    assert storebackend.host_store(tmp_path / "one") == (first_store, first_id)
    assert storebackend.host_store(tmp_path / "two")[0] != first_store
    host = start_host(tmp_path / "one", sidecar.base_url, sidecar.token)
    try:
        assert f'host_id = "{first_id}"' in (tmp_path / "one" / "host.toml").read_text()
        done = governed_run(host, "tides")
    finally:
        host.stop(signal.SIGKILL)
    again = start_host(tmp_path / "one", sidecar.base_url, sidecar.token)
    try:
        with again.client("acme-app") as app:
            assert app.result(done["action_id"])["body"]["action_result"]["status"] == "completed"
        record = storebackend.read_host_store(
            tmp_path / "one", lambda store: store.get_action("acme", done["action_id"])
        )
        assert record is not None and record.status == "completed"
        assert b"tides" in storebackend.store_text(tmp_path / "one")
    finally:
        again.stop()
