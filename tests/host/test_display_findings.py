"""An approval's input holding code points a person would misread: the approval view announces them
(evidence ``display_findings``) and ``GET /aip/v1/approvals/{id}/display`` lists them, for approvers only
(docs/approvals.md "The approval flow": faithful display)."""

import hashlib
import json

import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, action_env, bearer, running

CT = {"Content-Type": "application/aip+json"}
SPOOF = {"note": "refund 10 EUR to account \u202e9876-5432\u202c then close", "user": "ad\u200bmin"}


@pytest.fixture
async def http(make_app):
    async with running(make_app(sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())) as client:
        yield client


async def pending(http, action_id: str, value: dict) -> str:
    env = action_env(f"msg_{action_id}", action_id, "cap:crewai:beta", value, key=f"k-{action_id}")
    answer = await http.post("/aip/v1/messages", content=json.dumps(env), headers={**CT, **bearer("acme-invoker")})
    return answer.json()["body"]["action_result"]["output"]["approval_id"]


async def test_a_spoofing_input_is_announced_in_the_view_and_listed_with_paths_and_code_points(http):
    approval_id = await pending(http, "act_spoof", {"topic": "t", **SPOOF})
    view = (await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
    [artifact] = [e for e in view["request"]["evidence"] if e["kind"] == "display_findings"]
    assert artifact["uri"] == f"/aip/v1/approvals/{approval_id}/display" and artifact["id"] == f"{approval_id}:display"
    answer = await http.get(artifact["uri"], headers=bearer("acme-both"))
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    assert body["findings"] == [
        {"path": "$.note", "index": 25, "code_point": "U+202E", "kind": "bidi_control", "key": False},
        {"path": "$.note", "index": 35, "code_point": "U+202C", "kind": "bidi_control", "key": False},
        {"path": "$.user", "index": 2, "code_point": "U+200B", "kind": "invisible", "key": False},
    ]
    assert body["truncated"] is False and body["input_hash"] == view["evidence_payload"]["input_hash"]

    assert artifact["hash"] == "sha256:" + hashlib.sha256(answer.content).hexdigest()


async def test_a_plain_input_has_no_display_evidence_and_an_empty_list(http):
    approval_id = await pending(http, "act_plain", {"topic": "refunds für café"})
    view = (await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
    assert [e["kind"] for e in view["request"]["evidence"]] == ["input_snapshot", "policy_decision"]
    body = (await http.get(f"/aip/v1/approvals/{approval_id}/display", headers=bearer("acme-both"))).json()
    assert body["findings"] == []


async def test_the_findings_are_for_approvers_of_the_tenant_only(http):
    approval_id = await pending(http, "act_who", {"topic": "t", **SPOOF})
    route = f"/aip/v1/approvals/{approval_id}/display"
    operator = await http.get(route, headers=bearer("acme-operator"))
    assert operator.status_code == 403 and operator.json()["body"]["error"]["error"]["code"] == "policy.forbidden"
    assert (await http.get(route, headers=bearer("acme-invoker"))).status_code == 403
    assert (await http.get(route, headers=bearer("globex-invoker"))).status_code in (403, 404)
    assert (await http.get("/aip/v1/approvals/apr_nope/display", headers=bearer("acme-both"))).status_code == 404
    # The role first, then the approval: an unknown id is 403 to anyone but an approver (the console's sign-in
    # tells an approver from an operator so, console.js signIn).
    for principal in ("acme-operator", "acme-invoker"):
        assert (await http.get("/aip/v1/approvals/apr_nope/display", headers=bearer(principal))).status_code == 403
