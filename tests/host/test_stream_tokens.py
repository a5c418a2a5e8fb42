"""Stream tokens: minted by an authenticated request, bound to one
principal, tenant and stream, valid for minutes, accepted as ``?stream_token=`` by
EventSource-style clients, and never logged."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kits.asgi_stream import open_stream
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, running, submit_action
from structlog.testing import capture_logs

from aip_crewai.contracts.errors import Unauthenticated
from aip_crewai.host.auth import stream_tokens
from aip_crewai.host.auth.stream_tokens import APPROVALS_SCOPE, action_scope, check, mint
from aip_crewai.host.http.state import host_state

KEY = b"k" * 32


@pytest.fixture
async def world(make_app):
    """A completed run of acme-invoker, approved by acme-both."""
    app = make_app(sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())
    async with running(app) as http:
        approval_id = (await submit_action(http, "tok_run"))["approval_id"]
        await http.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-both"),
            json={"decision": "approved", "reason": "ok"},
        )
        service = host_state(app).actions
        await service.wait(await service.store.get_action("acme", "tok_run"), 10)
        yield app, http


async def minted(http, path: str, principal: str = "acme-invoker") -> dict:
    response = await http.post(path, headers=bearer(principal))
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    return response.json()


async def test_a_token_replaces_the_authorization_header_on_its_action_stream(world, clock):
    app, http = world
    token = await minted(http, "/aip/v1/actions/tok_run/stream-token")
    assert token["stream_url"] == f"/aip/v1/actions/tok_run/events?stream_token={token['stream_token']}"
    assert token["expires_at"] == "2026-09-21T14:18:20.000Z"  # NOW + 300 s
    page = await http.get(token["stream_url"])
    assert page.status_code == 200 and page.json()["terminal"] is True
    streamed = await http.get(token["stream_url"], headers={"Accept": "text/event-stream"})
    assert streamed.status_code == 200 and "event: result" in streamed.text
    # After the result frame, EventSource's reconnect with the same URL gets 204 and stops.
    last_id = [line[4:] for line in streamed.text.splitlines() if line.startswith("id: ")][-1]
    again = await http.get(token["stream_url"], headers={"Accept": "text/event-stream", "Last-Event-ID": last_id})
    assert again.status_code == 204


async def test_a_token_opens_nothing_else(world):
    _, http = world
    token = (await minted(http, "/aip/v1/actions/tok_run/stream-token"))["stream_token"]
    assert (await http.get(f"/aip/v1/actions/other/events?stream_token={token}")).status_code == 401
    assert (await http.get(f"/aip/v1/actions/tok_run/result?stream_token={token}")).status_code == 401
    assert (await http.get(f"/aip/v1/approvals/events?stream_token={token}")).status_code == 401


async def test_the_token_expires_after_its_ttl(world, clock):
    _, http = world
    token = (await minted(http, "/aip/v1/actions/tok_run/stream-token"))["stream_token"]
    clock.now += 300 - 0.001
    assert (await http.get(f"/aip/v1/actions/tok_run/events?stream_token={token}")).status_code == 200
    clock.now += 0.001
    expired = await http.get(f"/aip/v1/actions/tok_run/events?stream_token={token}")
    assert expired.status_code == 401 and "expired" in expired.text


async def test_the_ttl_is_configurable(make_app, settings, clock):
    app = make_app(
        dataclasses.replace(settings, stream_token_ttl_s=10), sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport()
    )
    async with running(app) as http:
        token = await minted(http, "/aip/v1/approvals/stream-token", "acme-both")
    assert token["expires_at"] == "2026-09-21T14:13:30.000Z"


async def test_minting_checks_the_same_access_as_reading_the_events(world):
    _, http = world
    assert (await http.post("/aip/v1/actions/tok_run/stream-token")).status_code == 401
    assert (await http.post("/aip/v1/actions/tok_run/stream-token", headers=bearer("acme-operator"))).status_code == 403
    assert (
        await http.post("/aip/v1/actions/tok_run/stream-token", headers=bearer("globex-invoker"))
    ).status_code == 404
    assert (await http.post("/aip/v1/actions/nope/stream-token", headers=bearer("acme-invoker"))).status_code == 404
    assert (await http.post("/aip/v1/approvals/stream-token", headers=bearer("acme-invoker"))).status_code == 403


async def test_another_host_process_or_a_restart_does_not_accept_it(world, make_app):
    app, http = world
    token = (await minted(http, "/aip/v1/actions/tok_run/stream-token"))["stream_token"]
    app.state.host = dataclasses.replace(
        host_state(app), stream_token_key=stream_tokens.new_key()
    )  # what a restart does
    refused = await http.get(f"/aip/v1/actions/tok_run/events?stream_token={token}")
    assert refused.status_code == 401 and "another host process" in refused.text


async def test_an_approvals_token_opens_the_approval_stream(world):
    app, http = world
    token = await minted(http, "/aip/v1/approvals/stream-token", "acme-both")
    assert token["stream_url"].startswith("/aip/v1/approvals/events?stream_token=")
    stream = await open_stream(app, token["stream_url"])
    try:
        assert (await stream.next_event()).event == "ready"
    finally:
        await stream.close()


async def test_the_token_never_appears_in_the_logs(world):
    _, http = world
    with capture_logs() as logs:
        token = (await minted(http, "/aip/v1/actions/tok_run/stream-token"))["stream_token"]
        await http.get(f"/aip/v1/actions/tok_run/events?stream_token={token}")
        await http.get(f"/aip/v1/actions/tok_run/events?stream_token={token}x")  # a refused one too
    text = repr(logs)
    assert "request_finished" in text and token not in text and token[:20] not in text
    routes = {entry.get("route") for entry in logs if entry.get("event") == "request_finished"}
    assert routes == {"/aip/v1/actions/{action_id:str}/stream-token", "/aip/v1/actions/{action_id:str}/events"}


@given(
    principal=st.text(min_size=1, max_size=40),
    tenant=st.text(min_size=1, max_size=20),
    action=st.text(min_size=1, max_size=60),
    expires=st.integers(1, 2**50),
)
def test_every_minted_token_checks_for_its_scope_and_no_other(principal, tenant, action, expires):
    token = mint(KEY, principal, tenant, action_scope(action), expires)
    claims = check(KEY, token, scope=action_scope(action), now_ms=expires - 1)
    assert (claims.principal_id, claims.tenant, claims.expires_ms) == (principal, tenant, expires)
    with pytest.raises(Unauthenticated):
        check(KEY, token, scope=APPROVALS_SCOPE, now_ms=expires - 1)
    with pytest.raises(Unauthenticated):
        check(KEY, token, scope=action_scope(action), now_ms=expires)


@given(st.data())
def test_any_changed_character_is_refused(data):
    token = mint(KEY, "acme-invoker", "acme", APPROVALS_SCOPE, 10**13)
    index = data.draw(st.integers(0, len(token) - 1))
    replacement = data.draw(st.sampled_from("AQgw_-.x"))
    changed = token[:index] + replacement + token[index + 1 :]
    if changed != token:
        with pytest.raises(Unauthenticated):
            check(KEY, changed, scope=APPROVALS_SCOPE, now_ms=0)


@pytest.mark.parametrize(
    "token", ["", "ast1", "ast1..", "ast2.e30." + "A" * 43, "x" * (stream_tokens.MAX_TOKEN_CHARS + 1)]
)
def test_malformed_tokens_are_refused(token):
    with pytest.raises(Unauthenticated):
        check(KEY, token, scope=APPROVALS_SCOPE, now_ms=0)


def test_the_longest_ids_fit_a_token():
    """A principal id and an action id of 256 four-byte characters each (their bounds)."""
    scope = action_scope("\U0001f600" * 256)
    token = mint(KEY, "\U0001f600" * 256, "t" * 128, scope, 10**13)
    assert len(token) <= stream_tokens.MAX_TOKEN_CHARS
    assert check(KEY, token, scope=scope, now_ms=0).scope == scope


def test_a_token_at_the_length_bound_is_read_and_one_past_it_is_not():
    at_limit = "ast1." + "A" * stream_tokens.MAX_PAYLOAD_CHARS + "." + "A" * 43
    assert len(at_limit) == stream_tokens.MAX_TOKEN_CHARS
    with pytest.raises(Unauthenticated, match="not valid"):  # read, and its MAC checked
        check(KEY, at_limit, scope=APPROVALS_SCOPE, now_ms=0)
    over = "ast1." + "A" * (stream_tokens.MAX_PAYLOAD_CHARS + 1) + "." + "A" * 43
    with pytest.raises(Unauthenticated, match="malformed"):
        check(KEY, over, scope=APPROVALS_SCOPE, now_ms=0)
