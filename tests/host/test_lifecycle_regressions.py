"""Regressions of the action lifecycle: every path that ends an approval ends its action, a cancel and a
decision never both win, the stored dispatch state is the dispatch's own final word, and the store open
leaks nothing when cancelled."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Any

import httpx2
import pytest
from kits import aip
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, running
from kits.poll import until_async

from aip_crewai.contracts.aip import ActionResult
from aip_crewai.host.http.state import host_state
from aip_crewai.sse import encode_event

CT = {"Content-Type": "application/aip+json"}


def run_envelope(action_id: str) -> dict:
    return aip.envelope(
        aip.action(action_id, "cap:crewai:beta", {"topic": action_id}, f"k-{action_id}"),
        message_id=f"msg_{action_id}",
        sent_at="2026-09-21T14:13:20.000Z",
    )


async def submit_pending(http: httpx2.AsyncClient, action_id: str) -> str:
    response = await http.post(
        "/aip/v1/messages", content=json.dumps(run_envelope(action_id)), headers={**CT, **bearer("acme-invoker")}
    )
    assert response.status_code == 202, response.text
    return response.json()["body"]["action_result"]["output"]["approval_id"]


async def decide(http: httpx2.AsyncClient, approval_id: str, decision: str = "approved") -> httpx2.Response:
    return await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer("acme-both"),
        json={"decision": decision, "reason": "checked"},
    )


async def test_listing_approvals_fails_the_actions_whose_approval_it_expires(make_app, clock):
    """Regression: the approval list expired approvals without failing their actions; the sweep never
    revisited them, so the actions stayed pending until some other read."""
    app = make_app(sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())
    async with running(app) as http:
        await submit_pending(http, "exp_1")
        clock.now += 901  # past the 15-minute TTL
        listing = (
            await http.get("/aip/v1/approvals", params={"status": "expired"}, headers=bearer("acme-both"))
        ).json()
        assert [a["status"] for a in listing["approvals"]] == ["expired"]
        record = await host_state(app).actions.store.get_action("acme", "exp_1")  # no action read: the store as left
        assert record.status == "failed" and "policy.approval_expired" in record.result_json
        late = await decide(http, listing["approvals"][0]["request"]["id"])
        assert late.status_code == 409 and late.json()["body"]["error"]["error"]["code"] == "approval.expired"


async def test_cancelling_a_pending_action_withdraws_its_approval(make_app):
    """Regression: cancelling a pending action left its approval pending, and approving it later answered 200."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    app = make_app(sidecar_transport=fake.transport())
    async with running(app) as http:
        approval_id = await submit_pending(http, "wd_1")
        cancelled = await http.post("/aip/v1/actions/wd_1/cancel", headers=bearer("acme-invoker"))
        assert cancelled.json()["body"]["action_result"]["status"] == "cancelled"
        shown = (await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
        assert shown["status"] == "withdrawn"
        answer = await decide(http, approval_id)
        assert answer.status_code == 409 and answer.json()["body"]["error"]["error"]["code"] == "approval.withdrawn"
        assert fake.executions == 0


async def test_a_cancel_and_a_decision_never_both_win(make_app):
    """Regression: when a cancel won against an approval, the approver still got 200 (and the approval
    stayed approved) although the action never ran. Exactly one of them wins now, every time."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    app = make_app(sidecar_transport=fake.transport())
    async with running(app) as http:
        for n in range(30):
            action_id = f"race_{n}"
            approval_id = await submit_pending(http, action_id)
            cancel, decision = await asyncio.gather(
                http.post(f"/aip/v1/actions/{action_id}/cancel", headers=bearer("acme-invoker")),
                decide(http, approval_id),
            )
            cancel_result = cancel.json()["body"]["action_result"]
            withdrew = cancel_result.get("output", {}).get("provider_effect") == "none"
            approval = (await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
            if decision.status_code == 200:
                assert not withdrew and approval["status"] == "approved", (n, cancel_result, approval)
            else:
                assert decision.status_code == 409 and withdrew and approval["status"] == "withdrawn", (n, approval)


async def test_a_refused_start_is_queued_and_retried_under_the_same_job_and_key(make_app):
    """Issue 17 item 1: a start the sidecar provably did not admit (a refused connection, then a 503
    "shutting down" answered before admission) no longer burns the approval: the action goes back to
    `queued` (dispatch `not_sent`) and the same job id and idempotency key are sent again until admitted."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    starts: list[tuple[str, str | None]] = []
    queued_seen = asyncio.Event()

    def handle(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/jobs/stream" and request.method == "POST":
            starts.append((json.loads(request.content)["action_id"], request.headers.get("Idempotency-Key")))
            if len(starts) == 1:
                raise httpx2.ConnectError("connection refused", request=request)
            if len(starts) == 2:
                return httpx2.Response(503, json={"detail": "the sidecar is shutting down and admits no new jobs"})
            if not queued_seen.is_set():
                return httpx2.Response(503, json={"detail": "shutting down"})
        return fake.handle(request)

    app = make_app(sidecar_transport=httpx2.MockTransport(handle))
    async with running(app) as http:
        approval_id = await submit_pending(http, "refused_1")
        assert (await decide(http, approval_id)).status_code == 200
        service = host_state(app).actions

        async def queued() -> bool:  # the tenant's view while the start waits for its retry
            view = (await http.get("/aip/v1/actions/refused_1", headers=bearer("acme-invoker"))).json()
            assert view["state"] in ("running", "queued"), view
            return bool(view["state"] == "queued")

        await until_async(queued, interval=0.01, what="the action queued")
        queued_seen.set()
        record = await service.wait(await service.store.get_action("acme", "refused_1"), 15)
        assert record.status == "completed", record.result_json
        assert len(starts) >= 3 and len(set(starts)) == 1, starts  # one job id, one key, every time


async def test_a_start_refused_until_the_dispatch_deadline_fails_with_a_certain_outcome(make_app, settings, clock):
    """Issue 17 item 1: past `dispatch_deadline_seconds` the action fails with
    `connector.crewai.dispatch_deadline`, `uncertain_outcome: false`, dispatch `not_sent`."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        if request.url.path.startswith("/jobs") and request.method == "POST":
            clock.now += 0.6  # each refused attempt passes time on the host's clock
            raise httpx2.ConnectError("connection refused", request=request)
        return FakeSidecar(SIDECAR_TOKEN).handle(request)

    app = make_app(
        dataclasses.replace(settings, dispatch_deadline_s=1.0), sidecar_transport=httpx2.MockTransport(handle)
    )
    async with running(app) as http:
        approval_id = await submit_pending(http, "refused_2")
        assert (await decide(http, approval_id)).status_code == 200
        service = host_state(app).actions
        record = await service.wait(await service.store.get_action("acme", "refused_2"), 15)
        error = json.loads(record.result_json)["error"]
        assert record.status == "failed" and record.dispatch == "not_sent", record
        assert error["code"] == "connector.crewai.dispatch_deadline"
        assert error["details"]["uncertain_outcome"] is False and error["details"]["dispatch"] == "not_sent"
        assert error["details"]["attempts"] >= 2 and error["details"]["last_cause"] == "connector.crewai.transport"


async def test_a_store_open_cancelled_mid_connect_closes_its_connection(tmp_path, monkeypatch):
    """Regression: cancelling `Store.open` while SQLite was connecting leaked the connection and its
    thread; the sidecar's journal open did not. Both now use one cancel-safe worker start."""
    from aip_crewai.host.store import store as store_module

    started, gate, closed = threading.Event(), threading.Event(), threading.Event()
    real_connect = store_module.connect_sqlite

    class Tracked:
        def __init__(self, conn):
            self.conn = conn

        def close(self):
            self.conn.close()
            closed.set()

    def slow_connect(path):
        started.set()
        gate.wait(10)
        return Tracked(real_connect(path))

    monkeypatch.setattr(store_module, "connect_sqlite", slow_connect)
    tmp_path.chmod(0o700)
    task = asyncio.ensure_future(store_module.Store.open(tmp_path / "host.db"))
    assert await asyncio.to_thread(started.wait, 10)  # the connect is under way on the worker
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    assert await asyncio.to_thread(closed.wait, 10)


async def _pending_then_restart(make_app, settings, fake, action_id: str, **changes):
    """Submit a pending run with one app, then open the same store with a changed configuration."""
    async with running(make_app(sidecar_transport=fake.transport())) as http:
        approval_id = await submit_pending(http, action_id)
    return approval_id, make_app(dataclasses.replace(settings, **changes), sidecar_transport=fake.transport())


@pytest.mark.parametrize("change", ["crew_removed", "requester_lost_role"])
async def test_an_approval_of_a_revoked_action_fails_it_instead_of_running_it(make_app, settings, change):
    """Regression (security review item 13): an approval decided after the crew was removed from the tenant,
    or after the requester lost its invoker role, still ran the action once."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    if change == "crew_removed":
        changes = {"tenants": {**settings.tenants, "acme": ("alpha",)}}  # beta no longer routed to acme
    else:
        changes = {
            "principals": tuple(
                dataclasses.replace(p, roles=frozenset({"approver"})) if p.id == "acme-invoker" else p
                for p in settings.principals
            )
        }
    approval_id, app = await _pending_then_restart(make_app, settings, fake, f"rev_{change}", **changes)
    async with running(app) as http:
        answer = await decide(http, approval_id)
        assert answer.status_code == 403
        assert answer.json()["body"]["error"]["error"]["code"] == "policy.capability_revoked"
        record = await host_state(app).actions.store.get_action("acme", f"rev_{change}")
        assert record.status == "failed" and "policy.capability_revoked" in record.result_json
    assert fake.executions == 0


async def test_a_decision_applied_after_a_restart_rechecks_at_dispatch(make_app, settings):
    """A decision recorded before a restart is applied by the restarted host; if the crew was removed
    from the tenant meanwhile, the dispatch refuses it (checked again right before sending)."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    approval_id, app = await _pending_then_restart(
        make_app, settings, fake, "rev_dispatch", tenants={**settings.tenants, "acme": ("alpha",)}
    )
    async with running(app) as http:
        store = host_state(app).actions.store
        decided, _ = await store.decide_and_start(
            "acme", approval_id, "approved", "ok", "acme-both", store.now_ms(), start_if=lambda approval, action: True
        )
        assert decided is not None  # a started action, as a decision of a dead process would leave it
        service = host_state(app).actions
        service.start(await store.get_action("acme", "rev_dispatch"), stream=True)
        record = await service.wait(await store.get_action("acme", "rev_dispatch"), 10)
        assert record.status == "failed" and "policy.capability_revoked" in record.result_json
        assert record.dispatch == "not_sent"
        assert (await http.get("/aip/v1/actions/rev_dispatch", headers=bearer("acme-invoker"))).status_code == 200
    assert fake.executions == 0


async def test_a_provisional_result_is_corrected_on_read_from_the_sidecar_journal(make_app, monkeypatch):
    """Issue 17 item 3, on read (the periodic half is off here): a stored `cancelled_unconfirmed` with
    `uncertain_outcome: true` whose sidecar job the journal calls `failed`, `uncertain_outcome: false`
    (queued, never ran) reads as the journal's result on the next GET, and is then final."""
    from aip_crewai.contracts.errors import ConnectorCancelledUnconfirmed
    from aip_crewai.host.actions import recovery
    from aip_crewai.host.actions.normalize import failed_result

    async def no_periodic_correction(runtime):
        return None

    monkeypatch.setattr(recovery, "correct_provisional", no_periodic_correction)
    fake = FakeSidecar(SIDECAR_TOKEN)
    journal_says = {"error_type": "SidecarRestarted", "uncertain_outcome": False}

    def handle(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/jobs/acme:prov_1":
            return httpx2.Response(
                200,
                json={
                    "action_id": "acme:prov_1",
                    "crew_id": "beta",
                    "operation": "run",
                    "status": "failed",
                    "event_count": 1,
                    "output": None,
                },
            )
        if request.url.path == "/jobs/acme:prov_1/events":
            event = {"event": "failed", "sequence": 0, "data": journal_says}
            if "text/event-stream" in request.headers.get("accept", ""):  # the journal read back whole
                frame = encode_event(json.dumps(event), event="failed", id="0")
                return httpx2.Response(200, content=frame, headers={"content-type": "text/event-stream"})
            return httpx2.Response(200, json={"events": [event]})
        return fake.handle(request)

    app = make_app(sidecar_transport=httpx2.MockTransport(handle))
    async with running(app) as http:
        approval_id = await submit_pending(http, "prov_1")
        service = host_state(app).actions
        record = await service.store.get_action("acme", "prov_1")
        provisional = failed_result(
            "prov_1", ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True, dispatch="acknowledged")
        )
        assert await service.writer.finish("acme", "prov_1", provisional, "acknowledged") is not None
        assert approval_id and record is not None
        view = (await http.get("/aip/v1/actions/prov_1", headers=bearer("acme-invoker"))).json()
        error = view["result"]["error"]
        assert view["state"] == "failed" and error["code"] == "connector.crewai.execution_failed", view
        assert error["details"]["uncertain_outcome"] is False
        stored = await service.store.get_action("acme", "prov_1")
        assert recovery.is_final(stored, await service.result(stored))


async def test_cancelling_an_action_queued_for_a_retry_stops_it_before_anything_is_sent(make_app):
    """Issue 17 item 1 (the `dequeue` row of ARCHITECTURE.md §8): an approved run whose start was
    refused waits `queued` for its retry; a cancel then stops it at once, `cancelled` with
    `provider_effect: none`, and no further start is sent."""
    starts: list[str] = []

    def handle(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/jobs/stream":
            starts.append(request.method)
            raise httpx2.ConnectError("connection refused", request=request)
        return FakeSidecar(SIDECAR_TOKEN).handle(request)

    app = make_app(sidecar_transport=httpx2.MockTransport(handle))
    async with running(app) as http:
        approval_id = await submit_pending(http, "dequeue_1")
        assert (await decide(http, approval_id)).status_code == 200
        service = host_state(app).actions

        def retry_waiting() -> Any:
            live = service.live.get("acme", "dequeue_1")
            return live if live is not None and live.retry_waiting else None

        live = await until_async(retry_waiting, interval=0.005, what="queued for a retry")
        task = live.task
        answer = await http.post("/aip/v1/actions/dequeue_1/cancel", headers=bearer("acme-invoker"))
        assert answer.status_code == 200, answer.text
        result = answer.json()["body"]["action_result"]
        assert result["status"] == "cancelled", result
        assert result["output"] == {"remote_stop_confirmed": False, "provider_effect": "none"}
        await asyncio.wait({task}, timeout=5)
        assert task.done() and service.live.get("acme", "dequeue_1") is None  # its dispatch can send no more
        record = await service.store.get_action("acme", "dequeue_1")
        assert record.status == "cancelled" and record.dispatch == "not_sent" and len(starts) >= 1


def late_job_sidecar(action_id: str, job: dict[str, str]) -> httpx2.MockTransport:
    """A sidecar whose blocking ``knowledge_query`` start of ``action_id`` answers 504 (its wait ended before
    the job), whose job view says ``job["status"]`` and whose journal ends with a completed event."""
    job_id = f"acme:{action_id}"

    def handle(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/jobs" and request.method == "POST":
            return httpx2.Response(504, json={"detail": "the job did not end within timeout_ms"})
        if request.url.path == f"/jobs/{job_id}":
            done = job["status"] == "completed"
            return httpx2.Response(
                200,
                json={
                    "action_id": job_id,
                    "crew_id": "beta",
                    "operation": "knowledge_query",
                    "status": job["status"],
                    "event_count": 2 if done else 1,
                    "output": None,
                },
            )
        if request.url.path == f"/jobs/{job_id}/events":
            return httpx2.Response(
                200, json={"events": [{"event": "completed", "sequence": 1, "data": {"results": ["late"]}}]}
            )
        return FakeSidecar(SIDECAR_TOKEN).handle(request)

    return httpx2.MockTransport(handle)


def knowledge_query_envelope(action_id: str) -> dict:
    return {
        "aip_version": "1.0",
        "message_type": "aip.core.v1.action",
        "message_id": f"msg_{action_id}",
        "sent_at": "2026-09-21T14:13:20.000Z",
        "body": {
            "action": {
                "id": action_id,
                "capability_id": "cap:crewai:beta:knowledge_query",
                "input": {"query": ["lighthouse"]},
                "idempotency_key": f"k-{action_id}",
            }
        },
    }


async def test_a_blocking_start_stored_still_running_is_corrected_once_the_job_ends(make_app):
    """A blocking `knowledge_query` whose wait ended before its job (the sidecar answered 504 and the job
    view still said `running`, as a reference-style sidecar does after `timeout_ms`) is stored
    `remote_temporary`; it is not final, and the next read after the job ended gives its result."""
    job = {"status": "running"}
    app = make_app(sidecar_transport=late_job_sidecar("kq_1", job))
    async with running(app) as http:
        first = await http.post(
            "/aip/v1/messages",
            content=json.dumps(knowledge_query_envelope("kq_1")),
            headers={**CT, **bearer("acme-invoker")},
        )
        error = first.json()["body"]["action_result"]["error"]
        assert error["code"] == "connector.crewai.remote_temporary" and error["details"]["remote_status"] == 504
        view = (await http.get("/aip/v1/actions/kq_1", headers=bearer("acme-invoker"))).json()
        assert view["state"] == "failed"  # still running at the sidecar: the provisional result stands
        job["status"] = "completed"
        view = (await http.get("/aip/v1/actions/kq_1", headers=bearer("acme-invoker"))).json()
        assert view["state"] == "completed" and view["result"]["output"] == {"results": ["late"]}, view


async def test_a_read_racing_the_reconcilers_correction_answers_the_corrected_result(make_app):
    """Regression: a read holding the provisional row lost the correction race to the reconciler (its own
    correction changed nothing) and answered the stale `failed` row although `completed` was stored."""
    job = {"status": "running"}
    app = make_app(sidecar_transport=late_job_sidecar("kq_2", job))
    async with running(app) as http:
        await http.post(
            "/aip/v1/messages",
            content=json.dumps(knowledge_query_envelope("kq_2")),
            headers={**CT, **bearer("acme-invoker")},
        )
        service = host_state(app).actions
        stale = await service.store.get_action("acme", "kq_2")
        assert stale is not None and stale.status == "failed"
        job["status"] = "completed"
        fresh = await service.store.get_action("acme", "kq_2")
        assert fresh is not None
        # The reconciler's correction (this call, unless a background correction stored it first: either way the
        # row is `completed` before the stale reader refreshes).
        await service.writer.correct(fresh, ActionResult(action_id="kq_2", status="completed"))
        stored = await service.store.get_action("acme", "kq_2")
        assert stored is not None and stored.status == "completed"
        answered = await service.refresh(stale)  # the reader's own correction now changes nothing
        assert answered.status == "completed"
