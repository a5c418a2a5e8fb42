"""Several hosts on one PostgreSQL store (issue 21 item 2): every fence holds across replicas.

Two host processes (``host-a``, ``host-b``, 2-second dispatch leases) share a real PostgreSQL database and one
sidecar. Concurrent duplicates sent to both execute once; an approval is decided once; a follow on one host
sees the run the other dispatches; and after kill -9 of the dispatching host, the other takes its lease over
and finishes the action: nothing runs twice, nothing is lost. Skipped with one line without PostgreSQL.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import pytest

from aip_crewai.client import AipClientError, new_id
from host_process import start_host

pytest.importorskip("psycopg", reason="PostgreSQL tests skipped: psycopg is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEASE_S = 2


@pytest.fixture
def hosts(sidecar_factory, tmp_path, postgres_url):
    sidecar = sidecar_factory.start()
    started = [start_host(tmp_path / name, sidecar.base_url, sidecar.token, store=postgres_url,
                          host_options={"host_id": name, "lease_seconds": LEASE_S}) for name in ("host-a", "host-b")]
    try:
        yield started, sidecar
    finally:
        for host in started:
            host.stop(signal.SIGKILL)


def executions(sidecar, action_id: str) -> int:
    """Model calls the sidecar made for one action (the echo and slow crews: two per run)."""
    return sum(1 for line in sidecar.calls() if line.split()[3].endswith(action_id))


def test_duplicates_spread_over_two_hosts_execute_once_and_a_follow_on_either_sees_it(hosts):
    (a, b), sidecar = hosts
    action_id, key = new_id("act"), new_id("key")

    def submit(i: int) -> dict:
        with (a if i % 2 else b).client("acme-app") as app:
            return app.call("cap:crewai:echo", {"topic": "tides"}, action_id=action_id, idempotency_key=key)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(submit, range(16)))
    approvals = {answer["body"]["action_result"]["output"]["approval_id"] for answer in answers}
    assert len(approvals) == 1 and all(x["body"]["action_result"]["status"] == "pending_approval" for x in answers)
    approval_id = approvals.pop()

    def decide(host) -> str:
        with host.client("acme-approver") as approver:
            try:
                return approver.decide(approval_id, "approved", "two hosts")["decision"]
            except AipClientError as exc:
                return exc.code
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decisions = sorted(pool.map(decide, (a, b, a, b)))
    assert decisions.count("approved") == 1 and set(decisions) - {"approved"} == {"approval.already_decided"}

    with b.client("acme-app") as app:  # followed on b, whichever host dispatches
        events = list(app.follow(action_id))
    assert events[-1][0] == "result" and events[-1][1]["body"]["action_result"]["status"] == "completed"
    chunks = [e for name, e in events if name in ("chunk", "done")]
    sequences = [e["body"]["stream_chunk"]["sequence"] for e in chunks]
    assert sequences == list(range(len(sequences)))  # exactly once, in order
    with a.client("acme-app") as app:
        resumed = list(app.follow(action_id, last_event_id="sse_2"))
    assert [e["body"]["stream_chunk"]["sequence"] for n, e in resumed if n in ("chunk", "done")] == sequences[2:]
    assert executions(sidecar, action_id) == 2


def test_kill_9_of_the_dispatching_host_hands_its_action_to_the_other(hosts):
    (a, b), sidecar = hosts
    action_id, key = new_id("act"), new_id("key")
    with a.client("acme-app") as app, a.client("acme-approver") as approver:
        pending = app.call("cap:crewai:slow", {"topic": "storms"}, action_id=action_id, idempotency_key=key)
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "kill test")
    deadline = time.monotonic() + 60
    while executions(sidecar, action_id) == 0:  # a is dispatching: the sidecar runs the crew
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.05)
    a.process.send_signal(signal.SIGKILL)
    a.process.wait(timeout=30)
    with b.client("acme-app") as app:
        events = list(app.follow(action_id))
        final = app.result(action_id)["body"]["action_result"]
    assert final["status"] == "completed", final
    assert "storms" in final["output"]["raw"]
    sequences = [e["body"]["stream_chunk"]["sequence"] for n, e in events if n in ("chunk", "done")]
    assert sequences == list(range(len(sequences))) and len(sequences) > 10  # nothing lost, nothing twice
    assert executions(sidecar, action_id) == 2  # the crew ran once (two tasks, two model calls)
    assert '"action_resumed"' in b.log.read_text()  # b took the dead host's lease over and followed the job
