"""Least privilege inside a tenant (security review item 9): every cell of docs/security.md's
"Who reads what" table, in-process over the fake sidecar."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, base_document, bearer, running

from aip_crewai.host.config import load_settings
from aip_crewai.host.http.state import host_state

EXTRA = {"acme-invoker2": ["invoker"], "acme-approver2": ["approver"], "acme-approver3": ["approver"]}
CT = {"Content-Type": "application/aip+json"}


def token_of(principal: str) -> dict[str, str]:
    return {"Authorization": f"Bearer tok-{principal}"} if principal in EXTRA else bearer(principal)


@pytest.fixture
async def world(host_files, make_app):
    """A completed run of acme-invoker, approved by acme-approver2, and the app serving it."""
    doc = base_document()
    doc["principals"] += [
        {"id": pid, "tenant": "acme", "roles": roles, "token_sha256": hashlib.sha256(f"tok-{pid}".encode()).hexdigest()}
        for pid, roles in EXTRA.items()
    ]
    host_files.write(doc)
    settings = dataclasses.replace(load_settings(host_files.config, environ={}), readiness_interval_s=3600.0)
    app = make_app(settings, sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())
    async with running(app) as http:
        env = {
            "aip_version": "1.0",
            "message_type": "aip.core.v1.action",
            "message_id": "msg_perm",
            "sent_at": "2026-09-21T14:13:20.000Z",
            "body": {
                "action": {
                    "id": "perm_run",
                    "capability_id": "cap:crewai:beta",
                    "input": {"topic": "secret-input"},
                    "idempotency_key": "k-perm",
                }
            },
        }
        pending = await http.post("/aip/v1/messages", content=json.dumps(env), headers={**CT, **bearer("acme-invoker")})
        approval_id = pending.json()["body"]["action_result"]["output"]["approval_id"]
        decided = await http.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=token_of("acme-approver2"),
            json={"decision": "approved", "reason": "ok"},
        )
        assert decided.status_code == 200
        service = host_state(app).actions
        await service.wait(await service.store.get_action("acme", "perm_run"), 10)
        yield http, approval_id


async def status_capability(http, principal: str):
    env = {
        "aip_version": "1.0",
        "message_type": "aip.core.v1.action",
        "message_id": f"msg_st_{principal}",
        "sent_at": "2026-09-21T14:13:20.000Z",
        "body": {
            "action": {
                "id": f"st_{principal}",
                "capability_id": "cap:crewai:beta:status",
                "input": {"run_action_id": "perm_run"},
            }
        },
    }
    return await http.post("/aip/v1/messages", content=json.dumps(env), headers={**CT, **token_of(principal)})


#: principal -> expected status per resource (docs/security.md "Security": who reads what).
TABLE = {
    "acme-invoker": {
        "action": 200,
        "result": 200,
        "events": 200,
        "chunks": 200,
        "cancel": 200,
        "status": 200,
        "approvals": 403,
        "approval": 403,
    },
    "acme-invoker2": {
        "action": 404,
        "result": 404,
        "events": 404,
        "chunks": 404,
        "cancel": 404,
        "status": 404,
        "approvals": 403,
        "approval": 403,
    },
    "acme-approver2": {
        "action": 200,
        "result": 200,
        "events": 200,
        "chunks": 200,
        "cancel": 403,
        "status": 403,
        "approvals": 200,
        "approval": 200,
    },
    "acme-approver3": {
        "action": 404,
        "result": 404,
        "events": 404,
        "chunks": 404,
        "cancel": 403,
        "status": 403,
        "approvals": 200,
        "approval": 200,
    },
    "acme-operator": {
        "action": 200,
        "result": 403,
        "events": 403,
        "chunks": 403,
        "cancel": 403,
        "status": 403,
        "approvals": 200,
        "approval": 200,
    },
}


@pytest.mark.parametrize("principal", list(TABLE))
async def test_every_cell_of_the_read_table(world, principal):
    http, approval_id = world
    headers = token_of(principal)
    got = {
        "action": await http.get("/aip/v1/actions/perm_run", headers=headers),
        "result": await http.get("/aip/v1/actions/perm_run/result", headers=headers),
        "events": await http.get("/aip/v1/actions/perm_run/events", headers=headers),
        "chunks": await http.get("/aip/v1/actions/perm_run/chunks", headers=headers),
        "cancel": await http.post("/aip/v1/actions/perm_run/cancel", headers=headers),
        "status": await status_capability(http, principal),
        "approvals": await http.get("/aip/v1/approvals", params={"status": "approved"}, headers=headers),
        "approval": await http.get(f"/aip/v1/approvals/{approval_id}", headers=headers),
    }
    assert {name: response.status_code for name, response in got.items()} == TABLE[principal]
    action = got["action"]
    if action.status_code == 200:
        output_visible = "output" in action.json().get("result", {})
        assert output_visible == (principal != "acme-operator")  # operators read metadata only
        assert action.json()["result"]["status"] == "completed"
    approval = got["approval"]
    if approval.status_code == 200:  # the exact input is for approvers
        assert ("evidence_payload" in approval.json()) == principal.startswith("acme-approver")
    for response in got.values():
        assert b"secret-input" not in response.content or principal in (
            "acme-invoker",
            "acme-approver2",
            "acme-approver3",
        )
