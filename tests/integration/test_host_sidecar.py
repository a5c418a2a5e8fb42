"""The real host against the real sidecar and the offline crews (issue: host actions end to end).

One host and sidecar pair serves the module (``host_and_sidecar``): each test counts only its own action's
jobs and model calls, and the tests that list approvals or compare tenants use tenants of their own
(:data:`OWN_TENANTS`), so what another test left behind cannot satisfy or break them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import sqlite3
from urllib.parse import unquote

import httpx2
import pytest
from kits.host import ACME_CREWS, start_host
from kits.poll import until

from aip_crewai.client import AipClient, AipClientError, new_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.host_processes, pytest.mark.sidecar_jobs]

#: Tenants beside acme and beta, each used by one test: ``north`` and ``south`` for the isolation test (north sees
#: acme's crews, south only knowledge_b), ``clitest`` for the CLI test (its approver lists its queue).
OWN_TENANTS = {"north": ACME_CREWS, "south": ["knowledge_b"], "clitest": ACME_CREWS}
#: Bearer tokens of the principals of :data:`OWN_TENANTS` (``<tenant>-<role>``).
OWN_TOKENS = {
    "north-invoker": "tok-north-invoker-1",
    "south-invoker": "tok-south-invoker-1",
    "south-approver": "tok-south-approver-1",
    "clitest-invoker": "tok-clitest-invoker-1",
    "clitest-approver": "tok-clitest-approver-1",
}


@pytest.fixture(scope="module")
def host_and_sidecar(shared_sidecar, tmp_path_factory):
    """The module's host on the module's sidecar, with tenants acme, beta and :data:`OWN_TENANTS`."""
    principals = [
        {
            "id": principal,
            "tenant": principal.split("-")[0],
            "role": principal.split("-")[1],
            "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
        }
        for principal, token in OWN_TOKENS.items()
    ]
    host = start_host(
        tmp_path_factory.mktemp("host") / "host",
        shared_sidecar.base_url,
        shared_sidecar.token,
        tenants={"acme": ACME_CREWS, "beta": ["knowledge_b"], **OWN_TENANTS},
        extra_principals=principals,
    )
    try:
        yield host, shared_sidecar
    finally:
        host.stop()


def own_client(host, principal: str) -> AipClient:
    """An AIP client of a principal of :data:`OWN_TOKENS`."""
    return AipClient(host.base_url, token=OWN_TOKENS[principal])


def calls_of(sidecar, job_id: str) -> list[str]:
    """The model calls the sidecar made for its job ``job_id`` (``<tenant>:<action id>``: the call log's 4th column)."""
    return [line for line in sidecar.calls() if unquote(line.split()[3]) == job_id]


def journaled_jobs(sidecar, action_id: str) -> list[str]:
    """The ids of the sidecar's journaled jobs that name ``action_id`` (read beside the running sidecar)."""
    with contextlib.closing(sqlite3.connect(f"file:{sidecar.journal}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT action_id FROM jobs WHERE instr(action_id, ?) > 0", (action_id,)).fetchall()
    return [row[0] for row in rows]


def retained_runs(sidecar) -> int:
    return int(httpx2.get(f"{sidecar.base_url}/health", headers=sidecar.headers).json()["retained_runs"])


def approve_pending(host, result):
    approval_id = result["output"]["approval_id"]
    with host.client("acme-approver") as approver:
        return approver.decide(approval_id, "approved", "integration test")


def wait_status(client, action_id, statuses, deadline_s=60):
    def settled():
        status = client.action(action_id)
        return status if status["state"] in statuses else None

    return until(settled, timeout=deadline_s, interval=0.05, what=f"action {action_id} in {statuses}")


def test_approval_round_trip_stream_and_replay_by_key(host_and_sidecar):
    host, sidecar = host_and_sidecar
    with host.client("acme-app") as app:
        action_id, key = new_id("act"), new_id("key")
        pending = app.call("cap:crewai:echo", {"topic": "lighthouses"}, action_id=action_id, idempotency_key=key)
        result = pending["body"]["action_result"]
        assert result["status"] == "pending_approval"
        assert calls_of(sidecar, f"acme:{action_id}") == []
        assert approve_pending(host, result)["decision"] == "approved"
        events = list(app.follow(action_id))
        names = [name for name, _ in events]
        assert names[0] == "ack" and names[-1] == "result" and "chunk" in names and "done" in names
        final = events[-1][1]["body"]["action_result"]
        assert final["status"] == "completed" and "lighthouses" in final["output"]["raw"]
        assert all(task["task_id"] for task in final["output"]["tasks_output"])
        calls = len(calls_of(sidecar, f"acme:{action_id}"))
        assert calls >= 1
        again = app.call("cap:crewai:echo", {"topic": "lighthouses"}, action_id=action_id, idempotency_key=key)
        assert again["body"]["action_result"]["status"] == "completed"
        with pytest.raises(AipClientError) as info:
            app.call("cap:crewai:echo", {"topic": "volcanoes"}, action_id=action_id, idempotency_key=key)
        assert info.value.status == 409 and info.value.code == "action.idempotency_conflict"
        assert len(calls_of(sidecar, f"acme:{action_id}")) == calls
        status = app.call("cap:crewai:echo:status", {"run_action_id": action_id})
        assert status["body"]["action_result"]["output"]["status"] == "completed"
        # read again: the final view now comes from the host's cache, the same answer, still an action
        cached = app.call("cap:crewai:echo:status", {"run_action_id": action_id})
        first, second = dict(status["body"]["action_result"]), dict(cached["body"]["action_result"])
        read_id = second.pop("action_id")
        assert first.pop("action_id") != read_id and first == second
        assert app.action(read_id)["state"] == "completed"
        # resume after the third event: exactly the rest, once
        resumed = [(name, env["_sse_id"]) for name, env in app.follow(action_id, last_event_id="sse_2")]
        assert resumed == [(name, env["_sse_id"]) for name, env in events[3:]]


def test_fifty_concurrent_identical_requests_make_one_sidecar_job(host_and_sidecar):
    host, sidecar = host_and_sidecar
    action_id, key = new_id("act"), new_id("key")
    before = retained_runs(sidecar)

    def call(_):
        with host.client("acme-app") as app:
            return app.call(
                "cap:crewai:knowledge_a:knowledge_query",
                {"query": ["lighthouse"]},
                action_id=action_id,
                idempotency_key=key,
            )["body"]["action_result"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(call, range(50)))
    assert {r["status"] for r in results} == {"completed"}
    assert {json.dumps(r["output"], sort_keys=True) for r in results} == {
        json.dumps(results[0]["output"], sort_keys=True)
    }
    assert journaled_jobs(sidecar, action_id) == [f"acme:{action_id}"]
    assert retained_runs(sidecar) == before + 1  # no job under another id either


def test_denial_never_reaches_the_sidecar(host_and_sidecar):
    host, sidecar = host_and_sidecar
    before = retained_runs(sidecar)
    with host.client("acme-app") as app, host.client("acme-approver") as approver:
        action_id, key = new_id("act"), new_id("key")
        result = app.call("cap:crewai:echo", {"topic": "x"}, action_id=action_id, idempotency_key=key)
        approver.decide(result["body"]["action_result"]["output"]["approval_id"], "denied", "not today")
        final = app.call("cap:crewai:echo", {"topic": "x"}, action_id=action_id, idempotency_key=key)
        assert final["body"]["action_result"]["error"]["code"] == "policy.approval_denied"
    assert journaled_jobs(sidecar, action_id) == [] and retained_runs(sidecar) == before
    assert calls_of(sidecar, f"acme:{action_id}") == []


def test_cancel_of_a_streaming_run(host_and_sidecar):
    host, sidecar = host_and_sidecar
    with host.client("acme-app") as app:
        action_id, key = new_id("act"), new_id("key")
        result = app.call("cap:crewai:slow", {"topic": "patience"}, action_id=action_id, idempotency_key=key)
        approve_pending(host, result["body"]["action_result"])
        wait_status(app, action_id, {"running"})
        until(lambda: len(app.chunks(action_id)["chunks"]) >= 2, interval=0.05, what="two chunks streamed")
        cancelled = app.cancel(action_id)["body"]["action_result"]
        assert cancelled["status"] == "cancelled"
        assert cancelled["output"]["remote_stop_confirmed"] is True
        calls = len(calls_of(sidecar, f"acme:{action_id}"))
        view = httpx2.get(f"{sidecar.base_url}/jobs/acme:{action_id}", headers=sidecar.headers).json()
        assert view["status"] == "cancelled"
        assert app.action(action_id)["state"] == "cancelled"
    assert len(calls_of(sidecar, f"acme:{action_id}")) <= calls + 1


def test_tenants_cannot_see_each_other(host_and_sidecar):
    host, _ = host_and_sidecar  # north sees acme's crews, south only knowledge_b; no other test uses them
    with (
        own_client(host, "north-invoker") as north,
        own_client(host, "south-invoker") as south,
        own_client(host, "south-approver") as south_approver,
    ):
        action_id, key = new_id("act"), new_id("key")
        pending = north.call("cap:crewai:echo", {"topic": "secret"}, action_id=action_id, idempotency_key=key)
        approval_id = pending["body"]["action_result"]["output"]["approval_id"]
        assert {c["id"] for c in south.manifest()["capabilities"]} == {"cap:crewai:knowledge_b:knowledge_query"}
        for call in (
            lambda: south.call("cap:crewai:echo", {"topic": "x"}, idempotency_key="k"),
            lambda: south.action(action_id),
            lambda: south_approver.approval(approval_id),
            lambda: south_approver.decide(approval_id, "approved", "not mine"),
        ):
            with pytest.raises(AipClientError) as info:
                call()
            assert info.value.status == 404
        assert south_approver.approvals()["approvals"] == []
        answer = south.call(
            "cap:crewai:knowledge_b:knowledge_query", {"query": ["lighthouse keeper"]}, idempotency_key=new_id("k")
        )
        assert "lighthouse" not in json.dumps(answer["body"]["action_result"]["output"]).lower()


def test_host_on_a_taken_port_fails_cleanly(tmp_path):
    import socket
    import subprocess
    import sys

    from kits.host import write_config

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = write_config(tmp_path / "h", "http://127.0.0.1:9", "tok", taken.getsockname()[1])
        result = subprocess.run(
            [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2  # a configuration error, as a bad host.toml (docs/reference/cli.md "Exit codes")
    assert "cannot listen on" in result.stderr and "Traceback" not in result.stderr


def test_cli_call_and_approvals(host_and_sidecar, tmp_path):
    import subprocess
    import sys

    host, _ = host_and_sidecar  # tenant clitest: its approver's queue holds only this test's approvals

    def cli(principal, *args):
        token = tmp_path / f"{principal}.token"
        if not token.exists():
            token.write_text(OWN_TOKENS[principal] + "\n")
            token.chmod(0o600)
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "aip_crewai.cli",
                *args,
                "--url",
                host.base_url,
                "--token-file",
                str(token),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    answer = cli(
        "clitest-invoker",
        "call",
        "cap:crewai:knowledge_a:knowledge_query",
        "--input",
        '{"query": ["lamp"]}',
        "--idempotency-key",
        "cli-1",
    )
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["body"]["action_result"]["status"] == "completed"
    pending = cli(
        "clitest-invoker", "call", "cap:crewai:echo", "--input", '{"topic": "cli"}', "--idempotency-key", "cli-2"
    )
    assert pending.returncode == 5, pending.stderr  # pending approval (docs/reference/cli.md "Exit codes")
    approval_id = json.loads(pending.stdout)["body"]["action_result"]["output"]["approval_id"]
    listed = cli("clitest-approver", "approvals", "list")
    assert [a["request"]["id"] for a in json.loads(listed.stdout)["approvals"]] == [approval_id]
    shown = json.loads(cli("clitest-approver", "approvals", "show", approval_id).stdout)
    assert shown["evidence_payload"]["input"] == {"topic": "cli"} and shown["status"] == "pending"
    decided = cli("clitest-approver", "approvals", "decide", approval_id, "denied", "--reason", "cli test")
    assert json.loads(decided.stdout)["decision"] == "denied"
    bad = cli("clitest-invoker", "call", "cap:crewai:echo", "--input", "[1]")
    assert bad.returncode == 2 and "must be a JSON object" in bad.stderr
