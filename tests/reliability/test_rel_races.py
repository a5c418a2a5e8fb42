"""Races between concurrent callers: one execution, one decision, one terminal state (ARCHITECTURE.md §7, §8)."""

from __future__ import annotations

import asyncio
import contextlib

import chaoslib
import httpx2
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.host_processes]


@pytest.mark.timeout(90)
def test_rel_concurrent_identical_requests_execute_once(shared_pair):
    """20 identical requests at once, 20 repeats after approval, 20 action ids under one key: one execution."""
    chaoslib.duplicate_requests(*shared_pair, n=20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attempt", range(3))
def test_rel_concurrent_approve_and_deny_give_exactly_one_decision(shared_pair, attempt):
    """10 concurrent approve/deny decisions of one approval: one 200, nine 409, the action follows the winner."""
    chaoslib.decision_race(shared_pair[2], n=10)


@pytest.mark.timeout(120)
def test_rel_cancel_racing_completion_ends_in_one_state_on_both_processes(shared_pair):
    """Cancels at offsets spanning a fast run's admission, execution and completion: host status == sidecar status."""
    _, sidecar, host = shared_pair
    outcomes = {chaoslib.cancel_race(sidecar, host, delay_s=delay / 100)["status"] for delay in range(0, 16)}
    assert outcomes <= {"completed", "cancelled"}


# ---------------------------------------------------- in-process regression


class SlowAdmission:
    """A FakeSidecar whose ``POST /jobs/stream`` is answered only after a cancel
    reached it or ``delay_s`` passed (a start request still in flight)."""

    def __init__(self, delay_s: float = 0.3) -> None:
        from kits.fake_sidecar import FakeSidecar
        from kits.hostapp import SIDECAR_TOKEN

        self.fake = FakeSidecar(SIDECAR_TOKEN)
        self.delay_s = delay_s
        self.cancel_seen: asyncio.Event | None = None
        self.cancel_statuses: list[int] = []

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        if self.cancel_seen is None:
            self.cancel_seen = asyncio.Event()
        if request.url.path == "/jobs/stream":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.cancel_seen.wait(), self.delay_s)
        response = self.fake.handle(request)
        if request.url.path.endswith("/cancel"):
            self.cancel_statuses.append(response.status_code)
            self.cancel_seen.set()
        return response


@pytest.mark.timeout(30)
async def test_rel_cancel_while_the_start_is_in_flight_waits_for_the_sidecar_answer(tmp_path):
    """Regression: a cancel that reached the sidecar before the in-flight start was admitted got 404, the
    host recorded `cancelled_unconfirmed` (failed) and dropped its stream, and the sidecar then admitted
    and completed the job: host failed, sidecar completed. Now the cancel waits for the start's answer."""
    from kits.hostapp import bearer, running
    from relkit import inproc_app

    sidecar = SlowAdmission()
    app = inproc_app(tmp_path / "etc", httpx2.MockTransport(sidecar.handle))
    env = {
        "aip_version": "1.0",
        "message_type": "aip.core.v1.action",
        "message_id": "msg_c1",
        "sent_at": "2026-09-21T23:33:20.000Z",
        "body": {
            "action": {
                "id": "act_c",
                "capability_id": "cap:crewai:beta",
                "input": {"topic": "t"},
                "idempotency_key": "k-c",
            }
        },
    }
    async with running(app) as http:
        pending = (await http.post("/aip/v1/messages", json=env, headers=bearer("acme-invoker"))).json()
        approval_id = pending["body"]["action_result"]["output"]["approval_id"]
        decided = await http.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-both"),
            json={"decision": "approved", "reason": "ok"},
        )
        assert decided.status_code == 200
        cancelled = (await http.post("/aip/v1/actions/act_c/cancel", headers=bearer("acme-invoker"))).json()
        status = (await http.get("/aip/v1/actions/act_c", headers=bearer("acme-invoker"))).json()
    job = sidecar.fake.jobs["acme:act_c"]
    assert sidecar.cancel_statuses == [200]  # never a 404 for a job that was being admitted
    assert status["state"] == cancelled["body"]["action_result"]["status"] == job.status == "completed"


@pytest.mark.timeout(30)
async def test_rel_a_cancel_that_finds_the_job_finished_records_its_real_outcome(tmp_path):
    """Regression: when the sidecar answered a cancel with an already completed job and no stream delivered
    the result, the host recorded `cancelled`; it now records the job's own terminal result, with the job's
    whole stream from the journal (a result settled from the journal carries every chunk)."""
    from kits.fake_sidecar import FakeSidecar

    from aip_crewai.contracts import operations as ops
    from aip_crewai.host.actions import cancellation
    from aip_crewai.host.actions.dispatch import Dispatcher, Job
    from aip_crewai.host.actions.service import ActionService
    from aip_crewai.host.sidecars.client import SidecarClient
    from aip_crewai.host.sidecars.connection import SidecarHttp
    from aip_crewai.host.store.store import Store

    tmp_path.chmod(0o700)
    fake = FakeSidecar()
    fake._admit({"crew_id": "support", "action_id": "acme:act_f", "operation": "run", "input": {}})
    http = SidecarHttp.of("http://127.0.0.1:8090", token="sidecar-token", transport=fake.transport())
    store = await Store.open(tmp_path / "host.db")
    try:
        service = ActionService(
            store,
            Dispatcher(SidecarClient(http, max_response_bytes=1 << 20), max_response_bytes=1 << 20),
            {"acme": {"support": frozenset({"run"})}},
        )
        job = Job(
            tenant="acme", action_id="act_f", crew_id="support", spec=ops.get("run"), input={}, idempotency_key="k"
        )
        ended = await cancellation.ended_before_cancel(service, job, {"status": "completed"})
        assert ended is not None
        result, chunks = ended  # with the job's whole stream, read back from its journal
        assert result.status == "completed" and result.output == fake.jobs["acme:act_f"].events[-1]["data"]
        assert [c.sequence for c in chunks] == [0, 1, 2] and chunks[-1].kind == "done"
        assert await cancellation.ended_before_cancel(service, job, {"status": "cancelled"}) is None
    finally:
        await store.close()
        await http.aclose()
