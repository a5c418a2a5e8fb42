"""An ``:events`` read sent right after its run's approval waits for the run's start to be answered by the
sidecar, instead of reaching the sidecar first and getting a 404 for a run that exists
(``dispatch_task.await_target_start``; ARCHITECTURE.md §9)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx2
import pytest
import structlog.testing
from kits import aip
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, envelope, post_message, running, submit_action
from kits.poll import until_async

from aip_crewai.host.actions import dispatch_task
from aip_crewai.host.http.state import host_state

pytestmark = pytest.mark.timeout(60)


class HeldStartSidecar(FakeSidecar):
    """A sidecar whose start of a run is held until :attr:`release` is set; it records the order in which it
    saw the run's start admitted and any request for the run's events."""

    def __init__(self) -> None:
        super().__init__(SIDECAR_TOKEN)
        self.release = asyncio.Event()
        self.start_held = asyncio.Event()
        self.events_asked = asyncio.Event()
        self.order: list[str] = []

    def transport(self) -> httpx2.MockTransport:
        return httpx2.MockTransport(self.handle_async)

    async def handle_async(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path in ("/jobs", "/jobs/stream") and request.method == "POST":
            self.start_held.set()
            await self.release.wait()
            self.order.append("start admitted")
        elif request.url.path.endswith("/events"):
            self.order.append("events asked" + (" (unknown job)" if not self.jobs else ""))
            self.events_asked.set()
        return self.handle(request)


async def approve_with_start_held(http: httpx2.AsyncClient, sidecar: HeldStartSidecar) -> None:
    """Submit run ``act_run``, approve it, and return once its start is on its way to ``sidecar`` (held there,
    not answered)."""
    approval_id = (await submit_action(http, "act_run"))["approval_id"]
    decided = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer("acme-both"),
        json={"decision": "approved", "reason": "ok"},
    )
    assert decided.status_code == 200
    await asyncio.wait_for(sidecar.start_held.wait(), 10)


async def test_an_events_read_right_after_the_approval_waits_for_the_runs_start(make_app, monkeypatch):
    sidecar = HeldStartSidecar()
    app = make_app(sidecar_transport=sidecar.transport())
    async with running(app) as http:
        await approve_with_start_held(http, sidecar)

        store = app.state.host.store
        polled, reads = asyncio.Event(), []
        get_action = store.get_action

        async def counting_get_action(tenant: str, action_id: str) -> Any:
            if action_id == "act_run":
                reads.append(action_id)
                if len(reads) >= 3:  # the wait reads the run again and again
                    polled.set()
            return await get_action(tenant, action_id)

        monkeypatch.setattr(store, "get_action", counting_get_action)
        body = aip.action("act_ev", "cap:crewai:beta:events", {"run_action_id": "act_run"})
        read = asyncio.create_task(post_message(http, "acme-invoker", envelope("msg_ev", body=body)))
        # Either the read keeps reading the run's record (it waits), or it has asked the sidecar (it did not).
        waits, asked = asyncio.create_task(polled.wait()), asyncio.create_task(sidecar.events_asked.wait())
        await asyncio.wait({waits, asked}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        waits.cancel()
        asked.cancel()
        sidecar.release.set()
        answer = await asyncio.wait_for(read, 30)
    assert sidecar.order[0] == "start admitted", sidecar.order
    assert "events asked (unknown job)" not in sidecar.order
    result = answer.json()["body"]["action_result"]
    assert result["status"] == "completed", result


async def test_the_wait_ends_at_its_bound_for_a_run_whose_start_is_never_answered(make_app, monkeypatch):
    """A run left unanswered (its sidecar holds the start): the read waits the bound, then asks the sidecar;
    its 404 for a run it has not admitted is answered the host's own view (an empty page)."""
    monkeypatch.setattr(dispatch_task, "TARGET_START_WAIT_S", 0.2)
    sidecar = HeldStartSidecar()
    app = make_app(sidecar_transport=sidecar.transport())
    async with running(app) as http:
        await approve_with_start_held(http, sidecar)
        body = aip.action("act_ev", "cap:crewai:beta:events", {"run_action_id": "act_run"})
        answer = await post_message(http, "acme-invoker", envelope("msg_ev", body=body))
        sidecar.release.set()
    assert sidecar.order[0] == "events asked (unknown job)", sidecar.order
    result = answer.json()["body"]["action_result"]  # the sidecar's 404: the host's own view, an empty page
    assert result["status"] == "completed" and result["output"]["events"] == [], result
    assert result["output"]["status"] == "running"


async def test_an_events_page_of_a_run_waiting_for_its_approval_is_an_empty_page_not_a_failure(make_app):
    """The sidecar does not know a run that waits for its approval (404): the host answers its own view of it,
    an empty page at the asked cursor with the run's state, as a ``status`` read answers the run's state, and logs
    no warning."""
    sidecar = FakeSidecar(SIDECAR_TOKEN)
    app = make_app(sidecar_transport=sidecar.transport())
    async with running(app) as http:
        await submit_action(http, "act_run")
        # The lifespan's first readiness check warns about this fake's bare health answer: on a slow machine it
        # could end inside the window below, so the window opens after it.
        await until_async(lambda: host_state(app).readiness.state.checked_at is not None, interval=0.005)
        body = aip.action("act_ev", "cap:crewai:beta:events", {"run_action_id": "act_run", "cursor": 2})
        with structlog.testing.capture_logs() as logs:
            answer = await post_message(http, "acme-invoker", envelope("msg_ev", body=body))
    assert answer.status_code == 200, answer.text
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == []  # an expected 404, not a failure
    result = answer.json()["body"]["action_result"]
    assert result["status"] == "completed", result
    assert result["output"] == {
        "action_id": "act_run",
        "cursor": 2,
        "next_cursor": 2,
        "status": "pending_approval",
        "events": [],
    }
    assert sidecar.executions == 0


class StartAnsweredDuringStatusSidecar(HeldStartSidecar):
    """The race of a ``status`` sent while its run's start is on the way: the sidecar answers the status 404
    (it has not admitted the run), and the start is answered before that 404 reaches the host."""

    def __init__(self) -> None:
        super().__init__()
        self.acknowledged: Any = None  # awaited after the 404 is decided, before it is sent
        self.status_answers: list[int] = []

    async def handle_async(self, request: httpx2.Request) -> httpx2.Response:
        if request.method == "GET" and request.url.path.count("/") == 2:  # GET /jobs/{id}: a status
            answer = self.handle(request)
            self.status_answers.append(answer.status_code)
            if answer.status_code == 404 and not self.release.is_set():
                self.release.set()
                await self.acknowledged()
            return answer
        return await super().handle_async(request)


async def test_a_status_answered_404_while_its_start_was_answered_is_asked_again(make_app):
    """The sidecar's 404 to a ``status`` says only that the run was not admitted when it looked. If the host
    then finds the run's start answered (``acknowledged``), the 404 may predate the admission: the host asks
    once more, where the store places the run, and answers that (it used to fail the read ``not_found`` for a
    run that exists)."""
    sidecar = StartAnsweredDuringStatusSidecar()
    app = make_app(sidecar_transport=sidecar.transport())

    async def acknowledged() -> None:
        async def answered() -> bool:
            record = await app.state.host.store.get_action("acme", "act_run")
            return record is not None and record.dispatch == "acknowledged"

        await until_async(answered, what="the run's start answered")

    sidecar.acknowledged = acknowledged
    async with running(app) as http:
        await approve_with_start_held(http, sidecar)
        body = aip.action("act_st", "cap:crewai:beta:status", {"run_action_id": "act_run"})
        answer = await post_message(http, "acme-invoker", envelope("msg_st", body=body))
    assert sidecar.status_answers == [404, 200]
    result = answer.json()["body"]["action_result"]
    assert result["status"] == "completed", result
    assert result["output"]["action_id"] == "act_run" and result["output"]["event_count"] == 3, result
