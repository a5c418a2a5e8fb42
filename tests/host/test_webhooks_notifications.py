"""``GET /aip/v1/approvals/{id}/notifications`` in-process (host/webhooks/notifications.py, docs/webhooks.md
"Notification state"): each state (none, queued, retrying, delivered, expired), the approval's read rules
(approvers and operators of its tenant), 404 for an unknown or another tenant's approval, and nothing about
the destination in the answer."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kits import aip
from kits.hostapp import bearer, envelope, running
from standardwebhooks.webhooks import Webhook

from aip_crewai.host.http.state import host_state
from aip_crewai.host.store.outbox import DELIVERED, EXPIRED, PENDING
from aip_crewai.host.webhooks.config import Endpoint, WebhookSettings, endpoint_id
from aip_crewai.host.webhooks.events import WebhookEvents
from aip_crewai.host.webhooks.notifications import overall_state

SECRET = "whsec_" + base64.b64encode(b"n" * 32).decode()
#: A URL whose path and query are secret parts: never in an answer.
URL_A, URL_B = "http://127.0.0.1:9/hook-a?token=sEcReT-a", "http://127.0.0.1:9/hook-b?token=sEcReT-b"
HOST_ID = "host-under-test"


def _endpoint(tenant: str, url: str, events: frozenset[str]) -> Endpoint:
    return Endpoint(endpoint_id=endpoint_id(tenant, url), tenant=tenant, url=url, signer=Webhook(SECRET), events=events)


def _hook(app: Any, *endpoints: Endpoint) -> None:
    """Write outbox rows for ``endpoints`` from now on (no sender runs: the test moves the rows itself)."""
    host_state(app).store.outbox_events = WebhookEvents(WebhookSettings(endpoints), {})


async def _request_approval(http: Any, action_id: str, *, principal: str = "acme-invoker") -> str:
    """A ``run`` needing an approval, submitted by ``principal``; returns its approval id."""
    capability = "cap:crewai:beta" if principal.startswith("acme") else "cap:crewai:gamma"
    env = envelope(
        f"msg_{action_id}",
        sent_at_s=time.time(),
        body=aip.action(action_id, capability, {"topic": "t"}, f"k-{action_id}"),
    )
    answer = await http.post(
        "/aip/v1/messages",
        content=json.dumps(env),
        headers={"Content-Type": "application/aip+json", **bearer(principal)},
    )
    result = answer.json()["body"]["action_result"]
    assert result["status"] == "pending_approval", answer.text
    return str(result["output"]["approval_id"])


def _route(approval_id: str) -> str:
    return f"/aip/v1/approvals/{approval_id}/notifications"


async def _read(http: Any, approval_id: str, principal: str = "acme-operator") -> dict[str, Any]:
    answer = await http.get(_route(approval_id), headers=bearer(principal))
    assert answer.status_code == 200, answer.text
    assert "sEcReT" not in answer.text and "hook-" not in answer.text and "127.0.0.1" not in answer.text
    assert "whe_" not in answer.text  # not even the endpoint id (a hash of the URL)
    return dict(answer.json())


async def _attempt(app: Any, status: str, *, outcome: str, retry_in_ms: int = 0) -> None:
    """Claim every due delivery and finish one attempt of each with ``status``."""
    store = host_state(app).store
    claimed = await store.claim_deliveries(HOST_ID, 30_000, 10)
    assert claimed
    for row in claimed:
        now = int(time.time() * 1000)
        written = await store.finish_attempt(
            row,
            HOST_ID,
            status=status,
            outcome=outcome,
            status_code=500 if outcome == "http_error" else None,
            started_at=now,
            duration_ms=3,
            retry_in_ms=retry_in_ms,
        )
        assert written is not None


async def test_without_a_subscribed_endpoint_the_state_is_none(make_app):
    app = make_app(clock=time.time)
    async with running(app) as http:
        _hook(app, _endpoint("acme", URL_A, frozenset({"action.completed"})))  # not approval.requested
        approval_id = await _request_approval(http, "act-none")
        body = await _read(http, approval_id)
        assert body == {
            "approval_id": approval_id,
            "action_id": "act-none",
            "event_type": "approval.requested",
            "state": "none",
            "notifications": [],
        }


async def test_queued_then_retrying_then_delivered(make_app):
    app = make_app(clock=time.time)
    async with running(app) as http:
        _hook(app, _endpoint("acme", URL_A, frozenset({"approval.requested"})))
        approval_id = await _request_approval(http, "act-q")
        body = await _read(http, approval_id)
        (queued,) = body["notifications"]
        assert body["state"] == "queued" and queued["state"] == "queued" and queued["attempts"] == 0
        assert queued["delivery_id"].startswith("msg_") and queued["next_attempt_at"].endswith("Z")
        assert queued["delivered_at"] is None and queued["expired_at"] is None and queued["last_outcome"] is None

        await _attempt(app, PENDING, outcome="http_error", retry_in_ms=0)
        body = await _read(http, approval_id)
        (retrying,) = body["notifications"]
        assert body["state"] == "retrying" and retrying["attempts"] == 1
        assert retrying["last_outcome"] == "http_error" and retrying["next_attempt_at"].endswith("Z")
        assert retrying["delivery_id"] == queued["delivery_id"]

        await _attempt(app, DELIVERED, outcome="delivered")
        body = await _read(http, approval_id, principal="acme-both")  # an approver reads it too
        (delivered,) = body["notifications"]
        assert body["state"] == "delivered" and delivered["state"] == "delivered" and delivered["attempts"] == 2
        assert delivered["delivered_at"].endswith("Z") and delivered["next_attempt_at"] is None
        assert delivered["expired_at"] is None


async def test_an_expired_delivery_reads_expired_and_outranks_a_delivered_one(make_app):
    app = make_app(clock=time.time)
    async with running(app) as http:
        _hook(app, _endpoint("acme", URL_A, frozenset({"approval.requested"})))
        approval_id = await _request_approval(http, "act-x")
        await _attempt(app, EXPIRED, outcome="endpoint_removed")
        body = await _read(http, approval_id)
        (expired,) = body["notifications"]
        assert body["state"] == "expired" and expired["state"] == "expired"
        assert expired["expired_at"].endswith("Z") and expired["delivered_at"] is None
        assert expired["next_attempt_at"] is None and expired["last_outcome"] == "endpoint_removed"


async def test_two_endpoints_give_two_notifications_and_the_least_advanced_state(make_app):
    app = make_app(clock=time.time)
    async with running(app) as http:
        _hook(
            app,
            _endpoint("acme", URL_A, frozenset({"approval.requested"})),
            _endpoint("acme", URL_B, frozenset({"approval.requested", "approval.decided"})),
        )
        approval_id = await _request_approval(http, "act-two")
        store = host_state(app).store
        first, second = await store.claim_deliveries(HOST_ID, 30_000, 10)
        now = int(time.time() * 1000)
        await store.finish_attempt(
            first, HOST_ID, status=DELIVERED, outcome="delivered", status_code=204, started_at=now, duration_ms=1
        )
        await store.finish_attempt(
            second, HOST_ID, status=PENDING, outcome="timeout", status_code=None, started_at=now, duration_ms=1,
            retry_in_ms=60_000,
        )  # fmt: skip
        body = await _read(http, approval_id)
        assert body["state"] == "retrying"
        assert sorted(n["state"] for n in body["notifications"]) == ["delivered", "retrying"]


async def test_read_rules_are_the_approvals_and_a_foreign_or_unknown_approval_is_404(make_app):
    app = make_app(clock=time.time)
    async with running(app) as http:
        _hook(
            app,
            _endpoint("acme", URL_A, frozenset({"approval.requested"})),
            _endpoint("globex", URL_A, frozenset({"approval.requested"})),
        )
        mine = await _request_approval(http, "act-mine")
        theirs = await _request_approval(http, "act-theirs", principal="globex-invoker")
        assert (await _read(http, mine, "acme-operator"))["state"] == "queued"
        assert (await _read(http, mine, "acme-both"))["state"] == "queued"
        forbidden = await http.get(_route(mine), headers=bearer("acme-invoker"))
        assert forbidden.status_code == 403
        assert forbidden.json()["body"]["error"]["error"]["code"] == "policy.forbidden"
        assert (await http.get(_route(mine))).status_code == 401
        for unknown in (theirs, "apr_nope", "x" * 300):
            answer = await http.get(_route(unknown), headers=bearer("acme-operator"))
            assert answer.status_code == 404, unknown
            assert answer.json()["body"]["error"]["error"]["code"] == "approval.not_found"


@given(st.lists(st.sampled_from(["queued", "retrying", "delivered", "expired"]), max_size=6))
def test_the_overall_state_is_delivered_only_when_every_delivery_is(states: list[Any]) -> None:
    overall = overall_state(states)
    assert (overall == "none") == (not states)
    assert (overall == "delivered") == (bool(states) and set(states) == {"delivered"})
    assert overall == "none" or overall in states
    if "retrying" in states:
        assert overall == "retrying"


@pytest.mark.parametrize("principal", ["acme-operator", "acme-both"])
async def test_the_route_answers_json_without_the_body_or_url(make_app, principal):
    app = make_app(clock=time.time)
    async with running(app) as http:
        _hook(app, _endpoint("acme", URL_A, frozenset({"approval.requested"})))
        approval_id = await _request_approval(http, f"act-{principal}")
        answer = await http.get(_route(approval_id), headers=bearer(principal))
        assert answer.headers["content-type"].startswith("application/json")
        (one,) = answer.json()["notifications"]
        assert set(one) == {
            "delivery_id",
            "state",
            "attempts",
            "created_at",
            "next_attempt_at",
            "delivered_at",
            "expired_at",
            "last_outcome",
        }
