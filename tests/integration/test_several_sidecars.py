"""Crews sharded over two real sidecars: each crew's actions go to its own sidecar; a crew on a stopped
sidecar is answered as with one sidecar (accepted: pending its approval, its start retried until the
dispatch deadline) while the other crew keeps working, and the host stays ready while one sidecar is."""

from __future__ import annotations

import json

import httpx2
import pytest
from kits.host import start_host
from kits.poll import until

from aip_crewai.client import new_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.host_processes]


def run_echo(host, crew: str, topic: str) -> dict:
    with host.client("acme-app") as app, host.client("acme-approver") as approver:
        action_id = new_id("act")
        pending = app.call(f"cap:crewai:{crew}", {"topic": topic}, action_id=action_id, idempotency_key=new_id("k"))
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "two sidecars")
        list(app.follow(action_id))
        return {"action_id": action_id, **app.result(action_id)["body"]["action_result"]}


def test_each_crew_runs_on_its_own_sidecar_and_a_stopped_one_takes_only_its_crews(sidecar_factory, tmp_path):
    first = sidecar_factory.start()
    second = sidecar_factory.start(journal=tmp_path / "second-journal.db")
    host = start_host(
        tmp_path / "host",
        first.base_url,
        first.token,
        host_options={"readiness_interval_ms": 200},
        sidecars=[
            {"url": first.base_url, "name": "one", "crews": ["echo", "slow", "knowledge_a"]},
            {"url": second.base_url, "name": "two", "crews": ["chatty", "knowledge_b"]},
        ],
    )
    try:
        echo = run_echo(host, "echo", "lagoons")
        chatty = run_echo(host, "chatty", "deltas")
        assert echo["status"] == chatty["status"] == "completed"

        def job_status(sidecar, action_id: str) -> int:  # each sidecar's journal knows only its own jobs
            return httpx2.get(f"{sidecar.base_url}/jobs/acme:{action_id}", headers=sidecar.headers).status_code

        assert (job_status(first, echo["action_id"]), job_status(second, echo["action_id"])) == (200, 404)
        assert (job_status(first, chatty["action_id"]), job_status(second, chatty["action_id"])) == (404, 200)

        def unready_lines() -> int:
            lines = [json.loads(x) for x in host.log.read_text().splitlines() if x.startswith("{")]
            return sum(1 for x in lines if x.get("event") == "readiness_changed" and x.get("ready") is False)

        before = unready_lines()
        second.kill()
        # the next readiness poll (200 ms) notices the stopped sidecar
        until(lambda: unready_lines() > before, interval=0.1, what="the host noticed the stopped sidecar")
        with host.client("acme-app") as app:
            waiting = app.call(
                "cap:crewai:chatty", {"topic": "x"}, action_id=new_id("act"), idempotency_key=new_id("k")
            )
        assert (
            waiting["body"]["action_result"]["status"] == "pending_approval"
        )  # accepted, docs/operating.md "Failure behaviour"
        assert httpx2.get(f"{host.base_url}/ready").status_code == 200  # one sidecar is ready
        assert run_echo(host, "echo", "reefs")["status"] == "completed"
    finally:
        host.stop()
