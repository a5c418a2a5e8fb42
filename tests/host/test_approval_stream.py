"""``GET /aip/v1/approvals/events``: the tenant's pending queue, then every
approval created, decided, expired or withdrawn, live and resumable, role-checked."""

from __future__ import annotations

import json

import pytest
from kits.asgi_stream import open_stream
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, running, submit_action
from structlog.testing import capture_logs

from aip_crewai.host.http import approval_stream, stopping
from aip_crewai.host.http.state import host_setup, host_state
from aip_crewai.host.store.records import StoreUnavailable


@pytest.fixture
async def world(make_app):
    app = make_app(sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())
    async with running(app) as http:

        async def submit(action_id: str, principal: str = "acme-invoker", capability: str = "cap:crewai:beta"):
            return (await submit_action(http, action_id, principal=principal, capability=capability))["approval_id"]

        yield app, http, submit


def data(event) -> dict:
    return json.loads(event.data)


async def test_a_fresh_stream_sends_the_queue_then_every_change_live(world, clock):
    app, http, submit = world
    first = await submit("run_1")
    stream = await open_stream(app, "/aip/v1/approvals/events", bearer("acme-both"))
    try:
        snapshot = await stream.next_event()
        assert (snapshot.event, snapshot.id) == ("pending", None)
        assert data(snapshot)["data"]["request"]["id"] == first
        ready = await stream.next_event()
        assert (ready.event, ready.id, data(ready)) == ("ready", "apv_1", {"position": "apv_1"})

        second = await submit("run_2")
        created = await stream.next_event()
        assert (created.event, created.id) == ("pending", "apv_2")
        event = data(created)
        assert event["kind"] == "approval.pending" and event["actor"]["id"] == "acme-invoker"
        assert event["action_id"] == "run_2" and event["data"]["request"]["id"] == second
        assert "evidence_payload" not in event["data"]  # the input is read with GET /aip/v1/approvals/{id}

        decided = await http.post(
            f"/aip/v1/approvals/{first}/decision",
            headers=bearer("acme-both"),
            json={"decision": "denied", "reason": "no"},
        )
        assert decided.status_code == 200
        change = await stream.next_event()
        assert (change.event, change.id) == ("decided", "apv_3")
        assert data(change)["actor"]["id"] == "acme-both" and data(change)["data"]["status"] == "denied"

        cancelled = await http.post("/aip/v1/actions/run_2/cancel", headers=bearer("acme-invoker"))
        assert cancelled.status_code == 200
        withdrawn = await stream.next_event()
        assert (withdrawn.event, withdrawn.id, data(withdrawn)["data"]["status"]) == ("withdrawn", "apv_4", "withdrawn")

        await submit("run_3")
        assert (await stream.next_event()).id == "apv_5"
        clock.now += 16 * 60  # past the 15-minute TTL
        await host_state(app).actions.expire_due()
        expired = await stream.next_event()
        assert (expired.event, expired.id) == ("expired", "apv_6")
        assert data(expired)["actor"]["id"] == "system:aip-crewai-host"
    finally:
        await stream.close()


async def test_every_connection_opens_with_the_servers_retry(world):
    app, _, submit = world
    await submit("run_1")
    for headers in (bearer("acme-both"), {**bearer("acme-both"), "Last-Event-ID": "apv_1"}):
        stream = await open_stream(app, "/aip/v1/approvals/events", headers)
        try:
            if "Last-Event-ID" in headers:
                await submit("run_2")
            await stream.next_event()
            assert stream.decoder.reconnection_ms == approval_stream.RETRY_MS == 3000
        finally:
            await stream.close()


async def test_last_event_id_resumes_exactly_after_it(world):
    app, http, submit = world
    ids = [await submit(f"run_{n}") for n in range(3)]
    stream = await open_stream(app, "/aip/v1/approvals/events", {**bearer("acme-both"), "Last-Event-ID": "apv_1"})
    try:
        got = [await stream.next_event(), await stream.next_event()]
        assert [(e.event, e.id) for e in got] == [("pending", "apv_2"), ("pending", "apv_3")]
        assert [data(e)["data"]["request"]["id"] for e in got] == ids[1:]
    finally:
        await stream.close()
    by_query = await open_stream(app, "/aip/v1/approvals/events?cursor=apv_2", bearer("acme-both"))
    try:
        assert (await by_query.next_event()).id == "apv_3"
    finally:
        await by_query.close()


@pytest.mark.parametrize("value", ["apv_x", "sse_1", "apv_" + "9" * 13, "apv_4"])
async def test_a_malformed_or_future_position_is_400(world, value):
    app, _, submit = world
    await submit("run_1")
    stream = await open_stream(app, "/aip/v1/approvals/events", {**bearer("acme-both"), "Last-Event-ID": value})
    await stream.close()
    assert stream.status == 400 and b"request.invalid_cursor" in stream.body


async def test_the_latest_position_is_accepted(world):
    app, _, submit = world
    await submit("run_1")
    stream = await open_stream(app, "/aip/v1/approvals/events", {**bearer("acme-both"), "Last-Event-ID": "apv_1"})
    await stream.close()
    assert stream.status == 200


@pytest.mark.parametrize("headers, status", [({}, 401), (bearer("acme-invoker"), 403)])
async def test_only_approvers_and_operators_follow_it(world, headers, status):
    app, _, _ = world
    stream = await open_stream(app, "/aip/v1/approvals/events", headers)
    await stream.close()
    assert stream.status == status


async def test_operators_follow_it_and_other_tenants_changes_never_appear(world):
    app, _, submit = world
    stream = await open_stream(app, "/aip/v1/approvals/events", bearer("acme-operator"))
    try:
        assert (await stream.next_event()).event == "ready"
        await submit("globex_run", principal="globex-invoker", capability="cap:crewai:gamma")
        await submit("acme_run")
        event = await stream.next_event()
        assert (event.id, data(event)["action_id"]) == ("apv_1", "acme_run")  # acme's own first position
    finally:
        await stream.close()


async def test_silence_is_filled_with_keep_alives(world, monkeypatch):
    app, _, _ = world
    monkeypatch.setattr(approval_stream, "KEEPALIVE_S", 0.01)
    stream = await open_stream(app, "/aip/v1/approvals/events", bearer("acme-both"))
    try:
        assert (await stream.next_event()).event == "ready"
        await stream.next_comment()
    finally:
        await stream.close()


async def test_shutdown_ends_the_stream_with_the_resume_comment(world):
    app, _, _ = world
    stream = await open_stream(app, "/aip/v1/approvals/events", bearer("acme-both"))
    assert (await stream.next_event()).event == "ready"
    host_setup(app).stopping.set()
    while not stream.ended:
        await stream._more()
    await stream.close()


def test_positions_round_trip():
    assert approval_stream.parse_position(approval_stream.position(42)) == 42
    assert approval_stream.parse_position("7") == 7


async def test_the_stream_rides_out_a_store_that_cannot_serve_it(world, monkeypatch):
    """A store fault while the stream is open (PostgreSQL stopped) used to end it with an error and a traceback:
    it now stays open with keep-alives, and the changes made meanwhile follow once the store answers; a fresh
    connection whose queue cannot be read yet waits the same way."""
    app, _, submit = world
    monkeypatch.setattr(approval_stream, "KEEPALIVE_S", 0.01)
    monkeypatch.setattr(stopping, "STORE_RETRY_S", 0.01)
    store = host_state(app).store
    await submit("run_1")
    failed: list[object] = []

    async def unavailable(*args: object, **kwargs: object) -> object:
        failed.append(args)
        raise StoreUnavailable()

    with pytest.MonkeyPatch.context() as fault:
        fault.setattr(store, "last_approval_event", unavailable)
        stream = await open_stream(app, "/aip/v1/approvals/events", bearer("acme-both"))
        try:
            await stream.next_comment()
            assert failed and stream.pending == []
        finally:
            fault.undo()
        try:
            assert [(e.event, e.id) for e in (await stream.next_event(), await stream.next_event())] == [
                ("pending", None),
                ("ready", "apv_1"),
            ]
            with capture_logs() as logs, pytest.MonkeyPatch.context() as again:
                again.setattr(store, "list_approval_events", unavailable)
                await stream.next_comment()
                await stream.next_comment()
                second = await submit("run_2")  # made while the stream cannot read it
            assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")], logs
            created = await stream.next_event()
            assert (created.event, created.id, data(created)["data"]["request"]["id"]) == ("pending", "apv_2", second)
        finally:
            await stream.close()
