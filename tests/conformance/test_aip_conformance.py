"""AIP 1.0 conformance: a full governed flow against the in-process host, with
every JSON body and every SSE ``data:`` payload validated against the official
AIP 1.0 schemas (the ``aip`` client's transport fails on the first violation,
naming the route, schema, JSON path and message), plus schema-valid inbound
variants that must be accepted."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aipschemas import check_envelope
from hostkit import NOW, bearer

from aip_crewai.contracts.aip import VOCABULARIES
from aip_crewai.host.store.store import ms_to_rfc3339
from aip_crewai.sse import SSEDecoder, encode_event

CT = {"Content-Type": "application/aip+json"}
SSE = {"Accept": "text/event-stream"}
_n = iter(range(1_000_000))


def envelope(body: dict[str, Any], message_type: str = "aip.core.v1.action", **extra: Any) -> dict[str, Any]:
    return {
        "aip_version": "1.0",
        "message_type": message_type,
        "message_id": f"msg_conf_{next(_n)}",
        "sent_at": ms_to_rfc3339(int(NOW * 1000)),
        "body": body,
        **extra,
    }


def action(action_id: str, cap: str, inp: Any, key: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": action_id, "capability_id": cap, "input": inp, **extra}
    if key is not None:
        body["idempotency_key"] = key
    return envelope({"action": body})


async def post(aip, env, principal="acme-invoker", *, schemas=None, headers=None):
    if schemas is not None:  # what the test sends is itself schema-valid
        check_envelope(schemas, "request POST /aip/v1/messages", env)
    return await aip.post(
        "/aip/v1/messages", content=json.dumps(env), headers={**CT, **bearer(principal), **(headers or {})}
    )


def frames(response) -> list[tuple[str, str | None, dict[str, Any]]]:
    decoder = SSEDecoder()
    return [(f.event, f.id, json.loads(f.data)) for f in [*decoder.feed(response.content), *decoder.close()]]


def body_of(document: dict[str, Any]) -> Any:
    (value,) = document["body"].values()
    return value


async def pending_run(aip, schemas, action_id, inp=None):
    response = await post(
        aip, action(action_id, "cap:crewai:beta", inp or {"topic": action_id}, key=f"k-{action_id}"), schemas=schemas
    )
    assert response.status_code == 202, response.text
    result = body_of(response.json())
    assert result["status"] == "pending_approval"
    return result["output"]["approval_id"]


async def decide(aip, approval_id, decision="approved", principal="acme-both", **extra):
    return await aip.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer(principal),
        json={"decision": decision, "reason": "checked", **extra},
    )


def test_state_vocabularies_are_the_schemas(schemas):
    """ActionLifecycleState, AckStatus, ActionResultStatus, StreamChunkKind, ErrorCategory, ... as the schemas define them."""
    defs = schemas.validators["envelope"].schema["$defs"]
    for name, values in VOCABULARIES.items():
        assert set(values) == {v["const"] for v in defs[name]["oneOf"]}, name


async def test_governed_flow_conforms(aip, fake, schemas):
    """Manifest, pending, approvals list/show/decision, result, status, events, chunks, streams: every body schema-valid."""
    for path in ("/aip/v1/manifest", "/aip/v1/capabilities"):
        manifest = (await aip.get(path, headers=bearer("acme-invoker"))).json()
        assert manifest["agent"]["id"] and all(b["profile"] for c in manifest["capabilities"] for b in c["bindings"])

    approval_id = await pending_run(aip, schemas, "conf_run", {"topic": "refunds"})
    listing = (await aip.get("/aip/v1/approvals", headers=bearer("acme-both"))).json()
    assert [a["request"]["id"] for a in listing["approvals"]] == [approval_id] and listing.get("cursor") is None
    shown = (await aip.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
    assert shown["evidence_payload"]["input"] == {"topic": "refunds"} and shown["status"] == "pending"
    assert shown["request"]["requester"]["id"] == "acme-invoker"
    decision = await decide(aip, approval_id)
    assert decision.status_code == 200 and decision.json()["approver"]["id"] == "acme-both"

    # the run completes in the background; its result, status and history
    for _ in range(200):
        result = await aip.get("/aip/v1/actions/conf_run/result", headers=bearer("acme-invoker"))
        if result.status_code == 200:
            break
    assert body_of(result.json())["status"] == "completed"
    status = (await aip.get("/aip/v1/actions/conf_run", headers=bearer("acme-invoker"))).json()
    assert status["state"] == "completed" and status["result_status"] == "completed"
    page = (await aip.get("/aip/v1/actions/conf_run/events", headers=bearer("acme-invoker"))).json()
    assert page["terminal"] is True and page.get("cursor") is None
    assert [e["kind"] for e in page["events"]][0] == "aip.core.v1.ack"
    assert page["events"][-1]["kind"] == "aip.core.v1.action_result"
    resumed = (await aip.get("/aip/v1/actions/conf_run/events?cursor=sse_1", headers=bearer("acme-invoker"))).json()
    assert [e["id"] for e in resumed["events"]][0] == "sse_2"
    chunks = (await aip.get("/aip/v1/actions/conf_run/chunks", headers=bearer("acme-invoker"))).json()
    assert [c["sequence"] for c in chunks["chunks"]] == [0, 1, 2] and chunks["events"] == []
    partial = (await aip.get("/aip/v1/actions/conf_run/chunks?cursor=1", headers=bearer("acme-invoker"))).json()
    assert [c["sequence"] for c in partial["chunks"]] == [1, 2]
    replay = await aip.get("/aip/v1/actions/conf_run/events", headers={**bearer("acme-invoker"), **SSE})
    replayed = frames(replay)
    assert replayed[0][0] == "ack" and body_of(replayed[0][2])["status"] == "cached"
    assert [f[0] for f in replayed] == ["ack", "chunk", "chunk", "done", "result"]
    # the same call again answers the stored result
    again = await post(aip, action("conf_run", "cap:crewai:beta", {"topic": "refunds"}, key="k-conf_run"))
    assert again.status_code == 200 and body_of(again.json())["status"] == "completed"


async def test_streams_and_modes_conform(aip, schemas):
    """Streaming reads, async mode, a pending stream and :status: ack, chunks, done, result frames."""
    approval_id = await pending_run(aip, schemas, "conf_target")
    assert (await decide(aip, approval_id)).status_code == 200
    streamed = await post(
        aip,
        action("conf_events", "cap:crewai:beta:events", {"run_action_id": "conf_target"}, mode="streaming"),
        schemas=schemas,
        headers=SSE,
    )
    names = [f[0] for f in frames(streamed)]
    assert names[0] == "ack" and names[-2:] == ["done", "result"] and "chunk" in names
    assert body_of(frames(streamed)[0][2])["status"] == "streaming"
    read = await post(
        aip,
        action("conf_kq", "cap:crewai:beta:knowledge_query", {"query": ["refunds"]}, key="k-kq", mode="streaming"),
        schemas=schemas,
        headers=SSE,
    )
    assert [f[0] for f in frames(read)][0] == "ack" and [f[0] for f in frames(read)][-1] == "result"

    asynchronous = await post(
        aip,
        action("conf_async", "cap:crewai:beta:knowledge_query", {"query": ["x"]}, key="k-async", mode="async"),
        schemas=schemas,
    )
    assert asynchronous.status_code in (200, 202)
    assert body_of(asynchronous.json())["action_id"] == "conf_async"

    # A stream of a pending action stays open until the decision (tests/host/test_pending_streams.py); here the
    # action is submitted, read while pending, approved, and its stream re-POSTed once it can end.
    pending_approval_id = await pending_run(aip, schemas, "conf_pending_stream", {"topic": "s"})

    status = await post(
        aip, action("conf_status", "cap:crewai:beta:status", {"run_action_id": "conf_pending_stream"}), schemas=schemas
    )
    assert status.status_code == 200 and body_of(status.json())["output"]["status"] == "pending_approval"
    assert (await decide(aip, pending_approval_id)).status_code == 200
    resumed = await post(
        aip,
        action("conf_pending_stream", "cap:crewai:beta", {"topic": "s"}, key="k-conf_pending_stream"),
        schemas=schemas,
        headers={**SSE, "Last-Event-ID": "sse_0"},
    )
    assert [f[0] for f in frames(resumed)][-1] == "result" and "ack" not in [f[0] for f in frames(resumed)]


async def test_cancel_denied_and_failed_conform(aip, fake, schemas):
    """Cancel (route and cancel message), a denied approval, a failed run with its SSE error frame."""
    await pending_run(aip, schemas, "conf_cancel")
    cancelled = await aip.post("/aip/v1/actions/conf_cancel/cancel", headers=bearer("acme-invoker"))
    assert body_of(cancelled.json())["status"] == "cancelled"
    await pending_run(aip, schemas, "conf_cancel_msg")
    by_message = await post(
        aip,
        envelope({"cancel": {"target": {"action": "conf_cancel_msg"}, "reason": "no"}}, "aip.core.v1.cancel"),
        schemas=schemas,
    )
    assert by_message.status_code == 200 and body_of(by_message.json())["status"] == "cancelled"

    approval_id = await pending_run(aip, schemas, "conf_denied")
    assert (await decide(aip, approval_id, "denied")).status_code == 200
    denied = body_of((await aip.get("/aip/v1/actions/conf_denied/result", headers=bearer("acme-invoker"))).json())
    assert denied["status"] == "failed" and denied["error"]["code"] == "policy.approval_denied"
    view = (await aip.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
    assert view["status"] == "denied" and view["decision"]["decision"] == "denied"

    events = [
        {"event": "started", "sequence": 0, "data": {"status": "running", "operation": "run"}},
        {
            "event": "failed",
            "sequence": 1,
            "data": {
                "status": "failed",
                "error_type": "RuntimeError",
                "message": "crew failed",
                "uncertain_outcome": False,
            },
        },
    ]
    fake.stream_override = b"".join(
        encode_event(json.dumps(e), event=e["event"], id=str(e["sequence"])) for e in events
    )
    approval_id = await pending_run(aip, schemas, "conf_failed")
    assert (await decide(aip, approval_id)).status_code == 200
    for _ in range(200):
        failed = await aip.get("/aip/v1/actions/conf_failed/result", headers=bearer("acme-invoker"))
        if failed.status_code == 200:
            break
    assert body_of(failed.json())["error"]["code"] == "connector.crewai.execution_failed"
    replay = frames(await aip.get("/aip/v1/actions/conf_failed/events", headers={**bearer("acme-invoker"), **SSE}))
    assert [f[0] for f in replay][-2:] == ["aip_error", "result"]  # not "error": EventSource.onerror
    assert body_of(replay[-2][2])["error"]["code"] == "connector.crewai.execution_failed"
    page = (await aip.get("/aip/v1/actions/conf_failed/events", headers=bearer("acme-invoker"))).json()
    assert [e["kind"] for e in page["events"]][-2:] == ["aip.core.v1.error", "aip.core.v1.action_result"]
    status = (await aip.get("/aip/v1/actions/conf_failed", headers=bearer("acme-invoker"))).json()
    assert status["state"] == "failed"


@pytest.mark.parametrize(
    "case",
    [
        "conflict",
        "bad_json",
        "bad_envelope",
        "unknown_type",
        "no_auth",
        "bad_token",
        "no_route",
        "bad_method",
        "unknown_action",
        "unknown_approval",
        "foreign_reader",
        "requester_decides",
        "other_approver",
        "policy_mismatch",
        "decided_twice",
        "no_reason",
        "missing_key",
    ],
)
async def test_errors_are_error_envelopes(aip, schemas, case):
    """Every refusal is an aip.core.v1.error envelope whose body is {"error": {"error": ProtocolError}}."""
    expected: dict[str, tuple[int, str]] = {
        "conflict": (409, "action.idempotency_conflict"),
        "bad_json": (400, "message.invalid_envelope"),
        "bad_envelope": (400, "message.invalid_envelope"),
        "unknown_type": (400, "message.invalid_envelope"),
        "no_auth": (401, "auth.unauthenticated"),
        "bad_token": (401, "auth.unauthenticated"),
        "no_route": (404, "route.not_found"),
        "bad_method": (405, "route.method_not_allowed"),
        "unknown_action": (404, "action.not_found"),
        "unknown_approval": (404, "approval.not_found"),
        "foreign_reader": (403, "policy.forbidden"),
        "requester_decides": (403, "policy.forbidden"),
        "other_approver": (403, "policy.forbidden"),
        "policy_mismatch": (409, "approval.policy_mismatch"),
        "decided_twice": (409, "approval.already_decided"),
        "no_reason": (400, "message.invalid_envelope"),
        "missing_key": (400, "action.idempotency_key_required"),
    }
    headers = {**CT, **bearer("acme-invoker")}
    if case == "conflict":
        await pending_run(aip, schemas, "conf_conflict")
        response = await post(
            aip, action("conf_conflict_2", "cap:crewai:beta", {"topic": "other"}, key="k-conf_conflict")
        )
    elif case == "bad_json":
        response = await aip.post("/aip/v1/messages", content=b"{not json", headers=headers)
    elif case == "bad_envelope":
        response = await post(aip, {**action("x", "cap:crewai:beta", {}), "aip_version": "2.0"})
    elif case == "unknown_type":
        response = await post(aip, envelope({"heartbeat": {}}, "aip.core.v1.heartbeat"))
    elif case == "no_auth":
        response = await aip.post(
            "/aip/v1/messages", content=json.dumps(action("x", "cap:crewai:beta", {})), headers=CT
        )
    elif case == "bad_token":
        response = await aip.get("/aip/v1/manifest", headers={"Authorization": "Bearer nope"})
    elif case == "no_route":
        response = await aip.get("/aip/v1/nowhere", headers=bearer("acme-invoker"))
    elif case == "bad_method":
        response = await aip.delete("/aip/v1/messages", headers=bearer("acme-invoker"))
    elif case == "unknown_action":
        response = await aip.get("/aip/v1/actions/never", headers=bearer("acme-invoker"))
    elif case == "missing_key":
        response = await post(aip, action("conf_nokey", "cap:crewai:beta", {"topic": "x"}))
    else:
        approval_id = await pending_run(aip, schemas, f"conf_{case}")
        if case == "unknown_approval":  # acme-operator may read approvals; this id does not exist
            response = await aip.get(f"/aip/v1/approvals/{approval_id}x", headers=bearer("acme-operator"))
        elif case == "foreign_reader":
            response = await aip.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("globex-invoker"))
        elif case == "requester_decides":
            response = await decide(aip, approval_id, principal="acme-invoker")
        elif case == "other_approver":
            response = await decide(aip, approval_id, approver={"id": "acme-approver", "kind": "human"})
        elif case == "policy_mismatch":
            response = await decide(aip, approval_id, policy_hash="0" * 64)
        elif case == "no_reason":
            response = await aip.post(
                f"/aip/v1/approvals/{approval_id}/decision", headers=bearer("acme-both"), json={"decision": "approved"}
            )
        else:
            assert (await decide(aip, approval_id, "denied")).status_code == 200
            response = await decide(aip, approval_id)
    status, code = expected[case]
    document = response.json()
    assert (response.status_code, body_of(document)["error"]["code"]) == (status, code), document


@pytest.mark.parametrize(
    "variant",
    [
        "mode_streaming",
        "mode_async",
        "mode_sync",
        "envelope_fields",
        "from_object",
        "from_string",
        "action_fields",
        "nulls",
        "plain_message_id",
    ],
)
async def test_schema_valid_inbound_variants_are_accepted(aip, schemas, variant):
    """Schema-valid envelopes are accepted; fields the host does not act on are ignored, never refused."""
    inp = {"query": [variant]}
    cap = "cap:crewai:beta:knowledge_query"
    headers: dict[str, str] = {}
    if variant == "mode_streaming":
        env = action(f"v_{variant}", cap, inp, key=variant, mode="streaming")
        headers = SSE
    elif variant in ("mode_async", "mode_sync"):
        env = action(f"v_{variant}", cap, inp, key=variant, mode=variant.removeprefix("mode_"))
    elif variant == "envelope_fields":
        env = {
            **action(f"v_{variant}", cap, inp, key=variant),
            "session_id": "ses_1",
            "correlation_id": "cor_1",
            "in_response_to": "msg_earlier",
            "to": {"id": "aip-crewai-host", "kind": "service"},
            "trace": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
            "extensions": {"vendor.example": {"x": 1}},
            "idempotency_key": variant,
        }
        env["body"]["action"].pop("idempotency_key")
    elif variant == "from_object":
        env = {
            **action(f"v_{variant}", cap, inp, key=variant),
            "from": {"id": "acme-invoker", "kind": "service", "display_name": "Acme app"},
        }
    elif variant == "from_string":  # not in the schema (Principal is an object), accepted for older clients
        env = {**action(f"v_{variant}", cap, inp, key=variant), "from": "acme-invoker"}
    elif variant == "action_fields":
        env = action(
            f"v_{variant}",
            cap,
            inp,
            key=variant,
            timeout_ms=60_000,
            observability={"trace_id": "t1", "span_id": "s1"},
            memory_context={"k": "v"},
            delegation_chain=[],
            conversation=None,
            compliance=None,
            callback=None,
        )
    elif variant == "nulls":
        env = {
            **action(f"v_{variant}", cap, inp, key=variant, mode=None, timeout_ms=None),
            "session_id": None,
            "correlation_id": None,
            "in_response_to": None,
            "from": None,
            "to": None,
        }
    else:
        env = {**action(f"v_{variant}", cap, inp, key=variant), "message_id": "3f1c9a52-plain-id"}
    response = await post(aip, env, schemas=None if variant == "from_string" else schemas, headers=headers)
    assert response.status_code in (200, 202), response.text
    if variant == "mode_streaming":
        assert [f[0] for f in frames(response)][-1] == "result"
    else:
        assert body_of(response.json())["action_id"] == f"v_{variant}"


async def test_official_approval_decision_body_is_accepted(aip, schemas):
    """The decision route takes the official ApprovalDecision object (approver = the caller)."""
    approval_id = await pending_run(aip, schemas, "conf_official")
    shown = (await aip.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
    body = {
        "approval_id": approval_id,
        "decision": "approved",
        "approver": {"id": "acme-both", "kind": "human"},
        "decided_at": ms_to_rfc3339(int(NOW * 1000)),
        "reason": "looks right",
        "policy_hash": shown["request"]["policy_hash"],
        "evidence": [],
        "constraints": [],
    }
    schemas.check("request decision", "approval_decision", body)
    response = await aip.post(f"/aip/v1/approvals/{approval_id}/decision", headers=bearer("acme-both"), json=body)
    assert response.status_code == 200 and response.json()["decision"] == "approved"


async def test_signed_decisions_and_approval_events_conform(aip, schemas):
    """A signed decision (its ``evidence``) and every frame of the approval stream (an AIP
    ``Event`` whose ``data`` is an ApprovalRecordView) are schema-valid."""
    from hostkit import private_key
    from ssekit import open_stream

    from aip_crewai.client import RequestSigner

    approval_id = await pending_run(aip, schemas, "conf_signed")
    signer = RequestSigner(private_key("acme-approver"), "acme-approver", clock=lambda: NOW)
    shown = (await aip.get(f"/aip/v1/approvals/{approval_id}", auth=signer)).json()
    decided = await aip.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        auth=signer,
        json={"decision": "approved", "reason": "signed", "policy_hash": shown["request"]["policy_hash"]},
    )
    assert decided.status_code == 200 and decided.json()["evidence"][0]["kind"] == "http_message_signature"
    record = (await aip.get(f"/aip/v1/approvals/{approval_id}", auth=signer)).json()
    assert record["decision"]["evidence"] == decided.json()["evidence"]
    assert (await aip.get(f"/aip/v1/approvals/{approval_id}/proof", auth=signer)).json()["key_id"] == "acme-approver"
    token = (await aip.post("/aip/v1/approvals/stream-token", headers=bearer("acme-both"))).json()
    assert token["stream_url"].startswith("/aip/v1/approvals/events?stream_token=")
    stream = await open_stream(aip.app, "/aip/v1/approvals/events", {**bearer("acme-both"), "Last-Event-ID": "apv_0"})
    try:
        events = [await stream.next_event(), await stream.next_event()]
    finally:
        await stream.close()
    assert [(e.event, e.id) for e in events] == [("pending", "apv_1"), ("decided", "apv_2")]
    for event in events:
        data = json.loads(event.data)
        schemas.check(f"GET /aip/v1/approvals/events frame {event.id}", "event", data)
        schemas.check(f"GET /aip/v1/approvals/events frame {event.id} data", "approval_record_view", data["data"])
