"""Several hosts on one PostgreSQL store: every fence holds across replicas.

Two host processes (``host-a``, ``host-b``, 2-second dispatch leases) share a real PostgreSQL database and two
sidecars (``one`` serves echo and the knowledge crews, ``two`` serves slow and chatty). Concurrent duplicates
sent to both execute once; an approval is decided once; a follow on one host sees the run the other
dispatches; concurrent cancels on both hosts stop a run once; a signed message id is accepted by one host
only; and after kill -9 of the dispatching host, the other takes its lease over and finishes the action:
nothing runs twice, nothing is lost. Skipped with one line without PostgreSQL.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import signal
import threading

import httpx2
import pytest
import storebackend
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kits.host import start_host
from kits.poll import until

from aip_crewai.client import CONTENT_TYPE, AipClient, AipClientError, new_id, sign_envelope

pytest.importorskip("psycopg", reason="PostgreSQL tests skipped: psycopg is not installed")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.host_processes,
    storebackend.only_in_postgresql_pass,  # its hosts are on PostgreSQL whatever the switch says
]

LEASE_S = 2


SIGNER = "acme-signer"  # an invoker holding only an Ed25519 key
SIGNER_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


@pytest.fixture
def hosts(sidecar_factory, tmp_path, postgres_url):
    """``([host-a, host-b], sidecar one, sidecar two)``: both hosts route each crew to its own sidecar."""
    one = sidecar_factory.start()
    two = sidecar_factory.start(journal=tmp_path / "two-journal.db")
    sidecars = [
        {"url": one.base_url, "name": "one", "crews": ["echo", "knowledge_a", "knowledge_b"]},
        {"url": two.base_url, "name": "two", "crews": ["slow", "chatty"]},
    ]
    public = base64.b64encode(SIGNER_KEY.public_key().public_bytes_raw()).decode()
    signer = {"id": SIGNER, "tenant": "acme", "role": "invoker", "ed25519_public_key": public}
    started = [
        start_host(
            tmp_path / name,
            one.base_url,
            one.token,
            store=postgres_url,
            sidecars=sidecars,
            extra_principals=[signer],
            host_options={"host_id": name, "lease_seconds": LEASE_S},
        )
        for name in ("host-a", "host-b")
    ]
    try:
        yield started, one, two
    finally:
        for host in started:
            host.stop(signal.SIGKILL)


def executions(sidecar, action_id: str) -> int:
    """Model calls made for one action (the echo and slow crews: two per run). The test sidecars share
    one call log: :func:`job_status` tells which sidecar ran a job."""
    return sum(1 for line in sidecar.calls() if line.split()[3].endswith(action_id))


def job_status(sidecar, action_id: str) -> int:
    """The HTTP status of the job's view on one sidecar: 200 where it ran, 404 on the other."""
    return httpx2.get(f"{sidecar.base_url}/jobs/acme:{action_id}", headers=sidecar.headers).status_code


def test_duplicates_spread_over_two_hosts_execute_once_and_a_follow_on_either_sees_it(hosts):
    (a, b), sidecar, other = hosts
    action_id, key = new_id("act"), new_id("key")

    def submit(i: int) -> dict:
        with (a if i % 2 else b).client("acme-app") as app:
            return app.call("cap:crewai:echo", {"topic": "tides"}, action_id=action_id, idempotency_key=key)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(submit, range(16)))
    approvals = {answer["body"]["action_result"]["output"]["approval_id"] for answer in answers}
    assert len(approvals) == 1 and all(x["body"]["action_result"]["status"] == "pending_approval" for x in answers)
    approval_id = approvals.pop()

    def decide(n: int) -> str:  # four different decisions (reasons): one is recorded (the same one again is a 200)
        with (a if n % 2 else b).client("acme-approver") as approver:
            try:
                return approver.decide(approval_id, "approved", f"two hosts, decision {n}")["decision"]
            except AipClientError as exc:
                return exc.code

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decisions = sorted(pool.map(decide, range(4)))
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
    assert (job_status(sidecar, action_id), job_status(other, action_id)) == (200, 404)


def test_kill_9_of_the_dispatching_host_hands_its_action_to_the_other(hosts):
    (a, b), _, sidecar = hosts  # slow runs on sidecar two
    action_id, key = new_id("act"), new_id("key")
    with a.client("acme-app") as app, a.client("acme-approver") as approver:
        pending = app.call("cap:crewai:slow", {"topic": "storms"}, action_id=action_id, idempotency_key=key)
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "kill test")
    # a is dispatching: the sidecar runs the crew
    until(lambda: executions(sidecar, action_id) > 0, interval=0.05, what="the run started")
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


def test_concurrent_cancels_on_both_hosts_stop_the_run_once(hosts):
    """A run dispatched by one host, cancelled four times at once through both: every cancel answers
    the one outcome, the sidecar stopped the job, and nothing ran after the stop."""
    (a, b), one, two = hosts
    action_id = new_id("act")
    with a.client("acme-app") as app, b.client("acme-approver") as approver:
        pending = app.call("cap:crewai:slow", {"topic": "squalls"}, action_id=action_id, idempotency_key=new_id("k"))
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "cancel test")
        # streaming on sidecar two
        until(lambda: len(app.chunks(action_id)["chunks"]) >= 2, interval=0.05, what="the run streamed")
    barrier = threading.Barrier(4)

    def cancel(host) -> dict:
        with host.client("acme-app") as app:
            barrier.wait(timeout=30)
            return app.cancel(action_id)["body"]["action_result"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(cancel, (a, b, a, b)))
    calls_at_stop = executions(two, action_id)
    assert {o["status"] for o in outcomes} == {"cancelled"}, outcomes
    assert len({json.dumps(o, sort_keys=True) for o in outcomes}) == 1  # one outcome, whoever recorded it
    view = httpx2.get(f"{two.base_url}/jobs/acme:{action_id}", headers=two.headers).json()
    assert view["status"] == "cancelled"
    for host in (a, b):
        with host.client("acme-app") as app:
            assert app.action(action_id)["state"] == "cancelled"
            events = list(app.follow(action_id))
        assert events[-1][0] == "result" and events[-1][1]["body"]["action_result"] == outcomes[0]
        sequences = [e["body"]["stream_chunk"]["sequence"] for n, e in events if n in ("chunk", "done")]
        assert sequences == list(range(len(sequences)))
    assert (job_status(one, action_id), job_status(two, action_id)) == (404, 200)
    assert executions(two, action_id) <= calls_at_stop + 1


def test_a_signed_message_id_is_accepted_by_one_host_only(hosts):
    """The same signed envelope sent to both hosts at once: one accepts it, the other refuses the replay."""
    (a, b), one, _ = hosts
    for _ in range(3):
        envelope = AipClient(a.base_url).envelope("cap:crewai:echo", {"topic": "once"}, idempotency_key=new_id("k"))
        body = json.dumps(sign_envelope(envelope, SIGNER_KEY, SIGNER))
        barrier = threading.Barrier(2)

        def send(host) -> httpx2.Response:
            with httpx2.Client(base_url=host.base_url, timeout=30) as http:
                barrier.wait(timeout=30)
                return http.post("/aip/v1/messages", content=body, headers={"Content-Type": CONTENT_TYPE})

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(send, (a, b)))
        assert sorted(answer.status_code for answer in answers) == [202, 401], [x.text for x in answers]
        refused = next(answer for answer in answers if answer.status_code == 401)
        assert refused.json()["body"]["error"]["error"]["code"] == "auth.unauthenticated"
    assert executions(one, envelope["body"]["action"]["id"]) == 0  # pending approval: nothing ran
