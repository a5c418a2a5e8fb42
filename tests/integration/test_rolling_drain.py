"""A hot crew on two real sidecars under load, one drained (SIGUSR1) mid-load: a rolling upgrade loses no
run (docs/operating.md "Several sidecars"). Every governed run completes, each on exactly one sidecar (its journal
holds it, the other's does not), new jobs are placed on both, and the drained sidecar exits 0."""

from __future__ import annotations

import contextlib
import signal
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest
from kits.host import start_host
from kits.poll import until
from kits.sidecar import signal_tree

from aip_crewai.client import new_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420), pytest.mark.host_processes]

RUNS = 20


def governed_run(host, action_id: str) -> dict:
    """Submit a ``slow`` run (about 6 s), approve it, follow it to its end; its stored result."""
    with host.client("acme-app") as app, host.client("acme-approver") as approver:
        pending = app.call("cap:crewai:slow", {"topic": action_id}, action_id=action_id, idempotency_key=new_id("k"))
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "rolling drain")
        list(app.follow(action_id))
        return dict(app.result(action_id)["body"]["action_result"])


def journal_status(sidecar, action_id: str) -> str | None:
    """The job's status in ``sidecar``'s journal, or None when it never admitted it."""
    answer = httpx2.get(f"{sidecar.base_url}/jobs/acme:{action_id}", headers=sidecar.headers, timeout=30)
    return None if answer.status_code == 404 else str(answer.json()["status"])


def journaled_status(journal, action_id: str) -> str | None:
    """The job's status in the journal file of a sidecar that has exited (what ``GET /jobs`` answers on it: None when
    the job was never admitted, or archived)."""
    with contextlib.closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT status, archived FROM jobs WHERE action_id = ?", (f"acme:{action_id}",)).fetchone()
    return None if row is None or row[1] else str(row[0])


def test_draining_one_of_two_sidecars_of_a_crew_under_load_loses_no_run(sidecar_factory, tmp_path):
    first = sidecar_factory.start()
    second = sidecar_factory.start(journal=tmp_path / "second-journal.db")
    host = start_host(
        tmp_path / "host",
        first.base_url,
        first.token,
        host_options={"readiness_interval_ms": 200},
        sidecars=[
            {"url": first.base_url, "name": "one", "crews": ["echo", "slow", "chatty", "knowledge_a", "knowledge_b"]},
            {"url": second.base_url, "name": "two", "crews": ["slow"]},
        ],
    )
    ids = [new_id("act") for _ in range(RUNS)]
    try:
        with ThreadPoolExecutor(max_workers=RUNS) as pool:
            early = [pool.submit(governed_run, host, action_id) for action_id in ids[: RUNS // 2]]
            # Both sidecars run jobs of the crew before the drain: placement spreads the load.
            until(
                lambda: (
                    any(journal_status(first, a) for a in ids[: RUNS // 2])
                    and any(journal_status(second, a) for a in ids[: RUNS // 2])
                ),
                timeout=120,
                interval=0.2,
                what="jobs running on both sidecars",
            )
            signal_tree(first.process.pid, signal.SIGUSR1)
            late = [pool.submit(governed_run, host, action_id) for action_id in ids[RUNS // 2 :]]
            results = [future.result(timeout=360) for future in [*early, *late]]
        assert [r["status"] for r in results] == ["completed"] * RUNS, [r.get("error") for r in results]
        assert first.process.wait(timeout=120) == 0  # drained: every admitted job ended, then exit 0
        assert first.log_events("sidecar_drained")
        # its journal still holds the jobs it ran (read from the file: no sidecar is started again to ask it)
        where = {a: (journaled_status(first.journal, a), journal_status(second, a)) for a in ids}
        # Each run completed on exactly one sidecar, never started on the other.
        assert all(sorted(map(str, pair)) == ["None", "completed"] for pair in where.values()), where
        assert any(pair[0] == "completed" for pair in where.values())
        assert any(pair[1] == "completed" for pair in where.values())
    finally:
        host.stop()
