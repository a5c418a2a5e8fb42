"""The host's request bodies are JSON (host/http/limits.py ``JSON_BODY``): ``POST /aip/v1/messages`` and the
decision route refuse a body declared as anything else, or not declared, with 415
``message.unsupported_media_type`` (an AIP error envelope) before reading it; ``application/json`` and AIP's
``application/aip+json`` pass, with parameters and in any case (docs/reference/http-api.md)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from kits.hostapp import action_env, bearer, envelope, running, sign

REFUSED_TYPES = ["text/plain", "", "application/x-www-form-urlencoded", "application/vnd.other+json", "json"]
ACCEPTED_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/AIP+JSON", "application/aip+json"]


def refusal(answer) -> dict:
    assert answer.status_code == 415, answer.text
    assert answer.json()["message_type"] == "aip.core.v1.error"
    return answer.json()["body"]["error"]["error"]


def typed(kind: str) -> dict[str, str]:
    return {"Content-Type": kind} if kind else {}


@pytest.mark.parametrize("kind", REFUSED_TYPES)
async def test_a_message_not_declared_json_is_415_and_nothing_is_stored(client, kind):
    env = action_env("msg_mt", "act_mt", "cap:crewai:alpha", {"topic": "x"}, key="k-mt")
    answer = await client.post(
        "/aip/v1/messages", content=json.dumps(env), headers={**typed(kind), **bearer("acme-invoker")}
    )
    error = refusal(answer)
    assert error["code"] == "message.unsupported_media_type" and error["category"] == "permanent"
    assert error["details"] == {"content_type": kind, "accepted": ["application/aip+json", "application/json"]}
    assert "application/aip+json or application/json" in error["message"]
    assert (await client.get("/aip/v1/actions/act_mt", headers=bearer("acme-invoker"))).status_code == 404


@pytest.mark.parametrize("kind", ACCEPTED_TYPES)
async def test_json_and_aip_json_pass_with_parameters_in_any_case(client, kind):
    env = action_env(f"msg_{len(kind)}", "act_ok", "cap:crewai:alpha", {"topic": "x"}, key="k-ok")
    answer = await client.post(
        "/aip/v1/messages", content=json.dumps(env), headers={"Content-Type": kind, **bearer("acme-invoker")}
    )
    assert answer.status_code == 202, answer.text


async def test_a_bad_bearer_is_401_first_and_a_signed_envelope_is_415_before_its_body_is_read(client):
    env = envelope("msg_signed")
    wrong_token = await client.post(
        "/aip/v1/messages", content=json.dumps(env), headers={"Content-Type": "text/plain", "Authorization": "Bearer x"}
    )
    assert wrong_token.status_code == 401
    signed = sign(action_env("msg_s", "act_s", "cap:crewai:gamma", {"topic": "x"}), "globex-signer")
    refused = await client.post("/aip/v1/messages", content=json.dumps(signed), headers={"Content-Type": "text/plain"})
    assert refusal(refused)["code"] == "message.unsupported_media_type"


async def test_a_decision_not_declared_json_is_415_and_decides_nothing(client):
    env = action_env("msg_d", "act_d", "cap:crewai:alpha", {"topic": "x"}, key="k-d")
    pending = await client.post("/aip/v1/messages", json=env, headers=bearer("acme-invoker"))
    approval_id = pending.json()["body"]["action_result"]["output"]["approval_id"]
    body = json.dumps({"decision": "approved", "reason": "ok"})
    for kind in ("text/plain", ""):
        answer = await client.post(
            f"/aip/v1/approvals/{approval_id}/decision", content=body, headers={**typed(kind), **bearer("acme-both")}
        )
        assert refusal(answer)["code"] == "message.unsupported_media_type"
    shown = await client.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))
    assert shown.json()["status"] == "pending"
    decided = await client.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        content=body,
        headers={"Content-Type": "application/json;charset=UTF-8", **bearer("acme-both")},
    )
    assert decided.status_code == 200, decided.text


async def test_a_cors_preflight_is_answered_and_the_browser_post_it_allows_passes(make_app, settings):
    origin = "https://console.example"
    app = make_app(dataclasses.replace(settings, cors_origins=(origin,)))
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    env = action_env("msg_c", "act_c", "cap:crewai:alpha", {"topic": "x"}, key="k-c")
    async with running(app) as http:
        allowed = await http.options("/aip/v1/messages", headers={"Origin": origin, **preflight})
        posted = await http.post(
            "/aip/v1/messages",
            content=json.dumps(env),
            headers={"Origin": origin, "Content-Type": "application/json", **bearer("acme-invoker")},
        )
        simple = await http.post(  # a "simple" cross-origin request (no preflight) is text/plain: refused
            "/aip/v1/messages",
            content=json.dumps(env),
            headers={"Origin": origin, "Content-Type": "text/plain", **bearer("acme-invoker")},
        )
    assert allowed.status_code == 200 and posted.status_code == 202, posted.text
    assert refusal(simple)["code"] == "message.unsupported_media_type"
    assert simple.headers["access-control-allow-origin"] == origin  # the browser may read the refusal
