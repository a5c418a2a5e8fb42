"""``GET /aip/v1/webhooks/deliveries`` in-process (host/webhooks/routes.py, docs/webhooks.md "Listing
deliveries"): operators of the tenant only, the filters, the opaque cursor and the done flag, a typed 400 for
every bad value (each bound at its edge)."""

from __future__ import annotations

import base64
import dataclasses
import time
from typing import Any

import pytest
from kits.hostapp import bearer, running
from kits.poll import until_async
from kits.webhook_receiver import Receiver
from standardwebhooks.webhooks import Webhook

from aip_crewai.contracts.aip import ActionResult
from aip_crewai.host.http.state import host_state
from aip_crewai.host.webhooks.config import EVENT_TYPES, Endpoint, WebhookSettings, endpoint_id
from aip_crewai.host.webhooks.events import WebhookEvents

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
ROUTE = "/aip/v1/webhooks/deliveries"
URL_A, URL_B = "http://127.0.0.1:9/a", "http://127.0.0.1:9/b"


def _endpoint(tenant: str, url: str, events: frozenset[str]) -> Endpoint:
    return Endpoint(endpoint_id=endpoint_id(tenant, url), tenant=tenant, url=url, signer=Webhook(SECRET), events=events)


async def _with_deliveries(app: Any) -> None:
    """acme: a-1 completed, a-2 failed, a-3 cancelled to endpoint A (all events) and a-1 to B (completed
    only); globex: g-1 completed. Nothing is sent (no sender runs)."""
    settings = WebhookSettings(
        (
            _endpoint("acme", URL_A, frozenset(EVENT_TYPES)),
            _endpoint("acme", URL_B, frozenset({"action.completed"})),
            _endpoint("globex", URL_A, frozenset(EVENT_TYPES)),
        )
    )
    store = host_state(app).store
    store.outbox_events = WebhookEvents(settings, {})
    writer = host_state(app).actions.writer
    finished = [("acme", "a-1", "completed"), ("acme", "a-2", "failed"), ("acme", "a-3", "cancelled")]
    for tenant, action_id, status in [*finished, ("globex", "g-1", "completed")]:
        crew = "beta" if tenant == "acme" else "gamma"
        result = ActionResult(action_id=action_id, status=status)  # type: ignore[arg-type]
        await writer.write_answered(
            writer.answered(
                tenant, action_id, f"cap:crewai:{crew}", crew, "run", "{}", "ab" * 32, "inv", result, "acknowledged"
            )
        )


def _code(answer: Any) -> str:
    return str(answer.json()["body"]["error"]["error"]["code"])


async def test_operators_list_their_tenants_deliveries_and_no_one_else_does(make_app):
    app = make_app()
    async with running(app) as http:
        await _with_deliveries(app)
        page = (await http.get(ROUTE, headers=bearer("acme-operator"))).json()
        assert page["done"] is True and page["cursor"] is None
        found = {(d["action_id"], d["event_type"], d["endpoint_id"]) for d in page["deliveries"]}
        assert found == {
            ("a-1", "action.completed", endpoint_id("acme", URL_A)),
            ("a-1", "action.completed", endpoint_id("acme", URL_B)),
            ("a-2", "action.failed", endpoint_id("acme", URL_A)),
            ("a-3", "action.cancelled", endpoint_id("acme", URL_A)),
        }
        one = page["deliveries"][0]
        assert one["status"] == "pending" and one["attempts"] == 0 and one["history"] == []
        assert one["next_attempt_at"].endswith("Z") and one["finished_at"] is None
        assert "url" not in one and "body" not in one
        forbidden = await http.get(ROUTE, headers=bearer("acme-invoker"))
        assert forbidden.status_code == 403 and _code(forbidden) == "policy.forbidden"
        assert (await http.get(ROUTE)).status_code == 401


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"status": "pending"}, 4),
        ({"status": "delivered"}, 0),
        ({"event_type": "action.failed"}, 1),
        ({"action_id": "a-1"}, 2),
        ({"endpoint": endpoint_id("acme", URL_B)}, 1),
        ({"endpoint": endpoint_id("acme", URL_A), "action_id": "a-1"}, 1),
        ({"action_id": "x" * 256}, 0),
    ],
)
async def test_the_filters_narrow_the_listing(make_app, query, expected):
    app = make_app()
    async with running(app) as http:
        await _with_deliveries(app)
        answer = await http.get(ROUTE, params=query, headers=bearer("acme-operator"))
        assert answer.status_code == 200
        assert len(answer.json()["deliveries"]) == expected


async def test_pages_follow_the_cursor_until_done(make_app):
    app = make_app()
    async with running(app) as http:
        await _with_deliveries(app)
        seen: list[str] = []
        cursor = None
        for expected_done in (False, False, True):
            params = {"limit": "2" if not seen else "1"} | ({"cursor": cursor} if cursor else {})
            page = (await http.get(ROUTE, params=params, headers=bearer("acme-operator"))).json()
            seen += [d["delivery_id"] for d in page["deliveries"]]
            assert page["done"] is expected_done and (page["cursor"] is None) is expected_done
            cursor = page["cursor"]
        assert len(seen) == 4 == len(set(seen))
        whole = (await http.get(ROUTE, params={"limit": "4"}, headers=bearer("acme-operator"))).json()
        assert [d["delivery_id"] for d in whole["deliveries"]] == seen and whole["done"] is True


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ({"status": "sent"}, "message.invalid_envelope"),
        ({"event_type": "action.started"}, "message.invalid_envelope"),
        ({"endpoint": "whe_123"}, "message.invalid_envelope"),
        ({"endpoint": "whe_" + "0" * 24 + "\n"}, "message.invalid_envelope"),
        ({"action_id": "x" * 257}, "message.invalid_envelope"),
        ({"action_id": "a/b"}, "message.invalid_envelope"),
        ({"limit": "0"}, "message.invalid_envelope"),
        ({"limit": "201"}, "message.invalid_envelope"),
        ({"limit": "-1"}, "message.invalid_envelope"),
        ({"cursor": "not-a-cursor"}, "request.invalid_cursor"),
        ({"cursor": "Wzk5OTk5OTk5OTk5OTk5OTk5OTk5OTk5OTk5LCJ4Il0"}, "request.invalid_cursor"),  # [10**26 - 1, "x"]
    ],
)
async def test_bad_values_are_a_typed_400(make_app, query, code):
    app = make_app()
    async with running(app) as http:
        answer = await http.get(ROUTE, params=query, headers=bearer("acme-operator"))
        assert answer.status_code == 400 and _code(answer) == code


async def test_the_limit_bounds_are_accepted_at_their_edges(make_app):
    app = make_app()
    async with running(app) as http:
        for limit in ("1", "200"):
            answer = await http.get(ROUTE, params={"limit": limit}, headers=bearer("acme-operator"))
            assert answer.status_code == 200 and answer.json() == {"deliveries": [], "cursor": None, "done": True}


async def test_the_lifespan_starts_the_sender_when_webhooks_are_configured(make_app, settings):
    """With ``[[webhooks]]`` the app's lifespan hooks the outbox to the store and runs one sender: a result
    stored through the app reaches the receiver, signed. Without (the same store file), no event is written."""
    receiver = await Receiver().start()
    try:
        hooked = dataclasses.replace(
            settings, webhooks=WebhookSettings((_endpoint("acme", receiver.url, frozenset({"action.completed"})),))
        )
        app = make_app(hooked, clock=time.time)  # the store's clock and the database's agree (deadlines)
        async with running(app):
            writer = host_state(app).actions.writer
            result = ActionResult(action_id="a-1", status="completed")
            await writer.write_answered(
                writer.answered(
                    "acme", "a-1", "cap:crewai:beta", "beta", "run", "{}", "ab" * 32, "inv", result, "acknowledged"
                )
            )
            await until_async(lambda: len(receiver.received) == 1, what="the delivery from the app's sender")
            headers, body = receiver.received[0]
            assert Webhook(SECRET).verify(body, headers)["data"]["action_id"] == "a-1"
            (delivery,) = await until_async(
                lambda: host_state(app).store.list_deliveries("acme", status="delivered"), what="delivered"
            )
            assert delivery.delivery_id == headers["webhook-id"]
        plain = make_app(clock=time.time)
        async with running(plain):
            assert host_state(plain).store.outbox_events is None
            writer = host_state(plain).actions.writer
            result = ActionResult(action_id="a-2", status="completed")
            await writer.write_answered(
                writer.answered(
                    "acme", "a-2", "cap:crewai:beta", "beta", "run", "{}", "ab" * 32, "inv", result, "acknowledged"
                )
            )
            assert await host_state(plain).store.list_deliveries("acme", action_id="a-2") == []
    finally:
        await receiver.stop()
