"""A stream opened on a pending action: the ack at ``sse_0`` (reason ``pending_approval``)
is its only frame while it waits, keep-alives fill the wait, and the decision's chunks and result follow on
the same connection; a re-POST of the envelope with ``Last-Event-ID`` resumes as the GET route does
(docs/reference/http-api.md "AIP 1.0 conformance": streams)."""

import json

import pytest
from kits.asgi_stream import open_stream
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, action_env, bearer, running
from structlog.testing import capture_logs

from aip_crewai.host.http import routes, stopping
from aip_crewai.host.http.state import host_state
from aip_crewai.host.store.records import StoreUnavailable

CT = {"Content-Type": "application/aip+json"}


@pytest.fixture
async def world(make_app, monkeypatch):
    monkeypatch.setattr(routes, "KEEPALIVE_S", 0.05)
    monkeypatch.setattr(routes, "PENDING_POLL_S", 0.01)
    app = make_app(sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())
    async with running(app) as http:
        yield app, http


def body(action_id: str) -> bytes:
    return json.dumps(
        action_env(f"msg_{action_id}", action_id, "cap:crewai:beta", {"topic": "a"}, key=f"k_{action_id}")
    ).encode()


async def post_stream(app, action_id: str, **headers: str):
    return await open_stream(
        app, "/aip/v1/messages", {**CT, **bearer("acme-invoker"), **headers}, method="POST", body=body(action_id)
    )


async def decide(http, action_id: str, decision: str) -> None:
    view = (await http.get(f"/aip/v1/actions/{action_id}", headers=bearer("acme-invoker"))).json()
    answer = await http.post(
        f"/aip/v1/approvals/{view['approval_id']}/decision",
        json={"decision": decision, "reason": "checked"},
        headers=bearer("acme-both"),
    )
    assert answer.status_code == 200, answer.text


async def rest(stream) -> list[tuple[str, str | None]]:
    frames: list[tuple[str, str | None]] = []
    while True:
        try:
            event = await stream.next_event()
        except EOFError:
            return frames
        frames.append((event.event, event.id))


async def test_a_pending_stream_stays_open_with_keep_alives_then_carries_the_run(world):
    app, http = world
    stream = await post_stream(app, "act_wait")
    try:
        ack = await stream.next_event()
        assert (ack.event, ack.id) == ("ack", "sse_0")
        assert json.loads(ack.data)["body"]["ack"] == {
            "action_id": "act_wait",
            "status": "accepted",
            "reason": "pending_approval",
        }
        await stream.next_comment()
        await stream.next_comment()  # still waiting: keep-alives, no result
        assert stream.pending == [] and not stream.ended
        await decide(http, "act_wait", "approved")
        frames = await rest(stream)
        assert frames[-1][0] == "result" and frames[-1][1] is not None
        assert all(name in ("chunk", "done", "result") for name, _ in frames)
        assert [ident for _, ident in frames] == [f"sse_{n}" for n in range(1, len(frames) + 1)]
    finally:
        await stream.close()


async def test_a_stream_rides_out_a_store_that_cannot_serve_it_then_carries_the_run(world, monkeypatch):
    # A store fault (PostgreSQL stopped) during an open stream used to end it with an error and a traceback
    # on every host but the dispatching one (which reads its own committed chunks): the stream now stays open
    # with keep-alives and goes on once the store answers.
    app, http = world
    monkeypatch.setattr(stopping, "STORE_RETRY_S", 0.01)
    store = host_state(app).store
    failed: list[object] = []

    async def unavailable(*args: object, **kwargs: object) -> object:
        failed.append(args)
        raise StoreUnavailable("the host store did not answer within 5000 ms")

    stream = await post_stream(app, "act_fault")
    try:
        assert (await stream.next_event()).id == "sse_0"
        with capture_logs() as logs, pytest.MonkeyPatch.context() as fault:
            fault.setattr(store, "follow_page", unavailable)
            await stream.next_comment()
            await stream.next_comment()  # keep-alives while every read fails
            assert len(failed) >= 2 and stream.pending == [] and not stream.ended
        assert not [entry for entry in logs if entry["log_level"] in ("error", "critical")], logs
        await decide(http, "act_fault", "approved")
        frames = await rest(stream)
        assert frames[-1][0] == "result" and frames[0] == ("chunk", "sse_1")
    finally:
        await stream.close()


async def test_a_denied_pending_stream_ends_with_the_error_and_the_result(world):
    app, http = world
    stream = await post_stream(app, "act_deny")
    try:
        assert (await stream.next_event()).id == "sse_0"
        await decide(http, "act_deny", "denied")
        assert await rest(stream) == [("aip_error", "sse_1"), ("result", "sse_2")]
    finally:
        await stream.close()


async def test_a_re_post_with_last_event_id_resumes_after_it_as_the_get_route_does(world):
    app, http = world
    first = await post_stream(app, "act_again")
    try:
        assert (await first.next_event()).id == "sse_0"
    finally:
        await first.close()
    await decide(http, "act_again", "approved")
    resumed = await post_stream(app, "act_again", **{"Last-Event-ID": "sse_0"})
    try:
        frames = await rest(resumed)
    finally:
        await resumed.close()
    got = await open_stream(
        app, "/aip/v1/actions/act_again/events", {**bearer("acme-invoker"), "Last-Event-ID": "sse_0"}
    )
    try:
        assert frames == await rest(got) and frames[0][0] != "ack" and frames[-1][0] == "result"
    finally:
        await got.close()
    done = await post_stream(app, "act_again", **{"Last-Event-ID": frames[-1][1]})
    assert done.status == 204  # all delivered: EventSource stops reconnecting
    await done.close()


async def test_a_stream_of_a_running_action_whose_sidecar_is_down_keeps_sending_keep_alives(make_app, monkeypatch):
    """No dispatch of the action runs here and its sidecar cannot be reached: the follower polls the store,
    and a proxy between it and the tenant still sees a keep-alive every ``KEEPALIVE_S`` (found by a break-it
    session: the stream was silent for the whole outage)."""
    import httpx2

    from aip_crewai.host.http.state import host_state

    def down(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused", request=request)

    monkeypatch.setattr(routes, "KEEPALIVE_S", 0.05)
    app = make_app(sidecar_transport=httpx2.MockTransport(down))
    async with running(app):
        store = host_state(app).store
        await store.create_action(
            "acme",
            "act_down",
            "cap:crewai:beta",
            "beta",
            "run",
            "{}",
            "h",
            "acme-invoker",
            "k",
            "running",
            dispatch="sent",
        )
        stream = await open_stream(app, "/aip/v1/actions/act_down/events", {**bearer("acme-invoker")})
        try:
            ack = await stream.next_event()
            assert (ack.event, ack.id) == ("ack", "sse_0")
            for _ in range(3):
                await stream.next_comment()
            assert not stream.ended
        finally:
            await stream.close()
