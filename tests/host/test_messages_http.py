"""POST /aip/v1/messages and the action/approval routes over HTTP, in-process (ARCHITECTURE.md §6, §7)."""

import json

import pytest
from kits import aip
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, action_env, bearer, count_store_calls, envelope, running, submit_action

CT = {"Content-Type": "application/aip+json"}


@pytest.fixture
def fake():
    return FakeSidecar(SIDECAR_TOKEN)


@pytest.fixture
async def http(make_app, fake):
    async with running(make_app(sidecar_transport=fake.transport())) as client:
        yield client


@pytest.fixture
async def app_http(make_app, fake):
    app = make_app(sidecar_transport=fake.transport())
    async with running(app) as client:
        yield app, client


async def post(http, principal, env, **headers):
    return await http.post("/aip/v1/messages", content=json.dumps(env), headers={**CT, **bearer(principal), **headers})


async def test_approval_round_trip_over_http(http, fake):
    env = action_env("msg_a", "act_run", "cap:crewai:beta", {"topic": "refunds"}, key="run-1")
    first = await post(http, "acme-invoker", env)
    assert first.status_code == 202
    result = first.json()["body"]["action_result"]
    assert result["status"] == "pending_approval" and fake.executions == 0
    approval_id = result["output"]["approval_id"]

    listing = await http.get("/aip/v1/approvals", headers=bearer("acme-both"))
    assert [a["request"]["id"] for a in listing.json()["approvals"]] == [approval_id]
    assert listing.json().get("cursor") is None
    shown = await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))
    assert shown.json()["evidence_payload"]["input"] == {"topic": "refunds"}

    # the requester may not approve its own action; another tenant cannot see it
    assert (
        await http.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-invoker"),
            json={"decision": "approved", "reason": "me"},
        )
    ).status_code == 403
    assert (await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("globex-invoker"))).status_code in (
        403,
        404,
    )

    decided = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer("acme-both"),
        json={"decision": "approved", "reason": "looks fine"},
    )
    assert decided.status_code == 200 and decided.json()["approver"]["id"] == "acme-both"
    again = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer("acme-both"),
        json={"decision": "denied", "reason": "changed my mind"},
    )
    assert again.status_code == 409

    env["message_id"] = "msg_b"
    replay = await post(http, "acme-invoker", env)
    assert replay.status_code == 200
    body = replay.json()["body"]["action_result"]
    assert body["status"] == "completed" and body["output"]["raw"].startswith("done:")
    assert fake.executions == 1

    status = await http.get("/aip/v1/actions/act_run", headers=bearer("acme-invoker"))
    assert status.json()["state"] == "completed" and status.json()["result_status"] == "completed"
    assert (await http.get("/aip/v1/actions/act_run", headers=bearer("globex-invoker"))).status_code == 404
    chunks = (await http.get("/aip/v1/actions/act_run/chunks?cursor=1", headers=bearer("acme-invoker"))).json()
    assert [c["sequence"] for c in chunks["chunks"]] == [1, 2] and chunks["terminal"] is True
    assert chunks.get("cursor") is None

    history = await http.get(
        "/aip/v1/actions/act_run/events", headers={**bearer("acme-invoker"), "Accept": "text/event-stream"}
    )
    events = list(aip.sse_events(history.content))
    assert [(name, ident) for name, ident, _ in events] == [
        ("ack", "sse_0"),
        ("chunk", "sse_1"),
        ("chunk", "sse_2"),
        ("done", "sse_3"),
        ("result", "sse_4"),
    ]
    resumed = await http.get(
        "/aip/v1/actions/act_run/events",
        headers={**bearer("acme-invoker"), "Accept": "text/event-stream", "Last-Event-ID": "sse_2"},
    )
    assert [ident for _, ident, _ in aip.sse_events(resumed.content)] == ["sse_3", "sse_4"]
    # an EventSource reconnecting after the result frame is told to stop: 204, as the SSE spec allows
    for last in ("sse_4", "sse_9"):
        ended = await http.get(
            "/aip/v1/actions/act_run/events",
            headers={**bearer("acme-invoker"), "Accept": "text/event-stream", "Last-Event-ID": last},
        )
        assert ended.status_code == 204 and ended.content == b""


async def test_changed_input_is_409_and_missing_key_is_400(http):
    env = action_env("msg_1", "act_1", "cap:crewai:beta", {"topic": "a"}, key="k1")
    assert (await post(http, "acme-invoker", env)).status_code == 202
    changed = action_env("msg_2", "act_1", "cap:crewai:beta", {"topic": "b"}, key="k1")
    response = await post(http, "acme-invoker", changed)
    assert response.status_code == 409
    assert response.json()["body"]["error"]["error"]["code"] == "action.idempotency_conflict"
    keyless = action_env("msg_3", "act_2", "cap:crewai:beta", {"topic": "a"})
    response = await post(http, "acme-invoker", keyless)
    assert response.status_code == 400
    assert response.json()["body"]["error"]["error"]["code"] == "action.idempotency_key_required"


async def test_streaming_read_only_call(http, fake):
    env = action_env("msg_q", "act_q", "cap:crewai:beta:knowledge_query", {"query": ["refund"]}, key="q1")
    response = await post(http, "acme-invoker", env, Accept="text/event-stream")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = list(aip.sse_events(response.content))
    assert [name for name, _, _ in events] == ["ack", "result"]
    assert events[-1][2]["body"]["action_result"]["output"] == {"results": [{"content": "policy"}]}


async def test_other_tenant_cannot_call_or_inspect(http):
    env = action_env("msg_g", "act_g", "cap:crewai:beta:status", {"run_action_id": "act_x"})
    response = await post(http, "globex-invoker", env)
    assert response.status_code == 404
    assert response.json()["body"]["error"]["error"]["code"] == "capability.not_found"


async def test_invalid_input_names_the_field(http):
    env = action_env("msg_i", "act_i", "cap:crewai:beta:knowledge_query", {"query": []}, key="i1")
    response = await post(http, "acme-invoker", env)
    assert response.status_code == 400
    assert response.json()["body"]["error"]["error"]["details"]["field"] == "$.query"


def _nested(levels: int, leaf: object) -> object:
    value = leaf
    for _ in range(levels):
        value = {"n": value}
    return value


@pytest.mark.parametrize("levels", [63, 64])
async def test_an_input_nested_past_its_bound_names_its_first_container_past_it(http, levels):
    """The refusal named ``$`` whatever nested too deep; at the bound (64 levels) the input is taken, at 65 the
    path of its 65th level is named."""
    env = action_env(f"msg_d{levels}", f"act_d{levels}", "cap:crewai:alpha", _nested(levels, {"topic": "x"}), "d1")
    response = await post(http, "acme-invoker", env)
    if levels == 63:  # 64 levels, the input object included
        assert response.status_code == 202, response.text
        return
    assert response.status_code == 400
    error = response.json()["body"]["error"]["error"]
    assert error["details"] == {"field": "$" + ".n" * 64, "rule": "nested deeper than 64 levels of objects and arrays"}


@pytest.mark.parametrize(
    ("where", "levels", "field"),
    [
        ("input", 10_000, "$.body.action.input" + ".n" * 64),
        ("extensions", 10_000, "$.extensions" + ".n" * 66),
        ("extensions", 100, "$.extensions" + ".n" * 66),
    ],
)
async def test_a_body_deeper_than_the_decoder_goes_names_its_first_container_past_the_bound(http, where, levels, field):
    """Past 1,000 levels (3.11) or 3,000 (3.12 and later) msgspec cannot decode the body; the refusal named
    ``$.body.action.input`` even for a deep ``extensions``: the path is now found in the text (10,000 levels:
    past the decoder on every Python). A deep ``extensions`` the decoder reads (100 levels, or 1,200 on 3.13)
    was accepted: refused as the envelope's bound names it."""
    env = action_env("msg_x", "act_x", "cap:crewai:alpha", {"topic": "x"}, "x1")
    marker = '"MARK"'
    if where == "input":
        env["body"]["action"]["input"] = "MARK"
    else:
        env["extensions"] = "MARK"
    deep = '{"n": ' * levels + "{}" + "}" * levels
    raw = json.dumps(env).replace(marker, deep)
    response = await http.post("/aip/v1/messages", content=raw, headers={**CT, **bearer("acme-invoker")})
    assert response.status_code == 400, response.text
    assert response.json()["body"]["error"]["error"]["details"]["field"] == field


@pytest.mark.parametrize(
    "sent_at",
    ["yesterday", "2026-12-02", "2026-12-02T08:30:00", "1796200200", "2026-13-45T99:99:99Z", "2026-12-02T24:00:00Z"],
)
async def test_a_sent_at_that_is_no_rfc_3339_timestamp_is_400_in_words(http, sent_at):
    """``sent_at`` is an RFC 3339 date-time (AIP envelope schema) whoever signs the message: a bearer
    principal's too. The message names the rule in words, never as a regular expression."""
    env = {**action_env("msg_t", "act_t", "cap:crewai:beta", {"topic": "x"}, key="t1"), "sent_at": sent_at}
    response = await post(http, "acme-invoker", env)
    assert response.status_code == 400, response.text
    message = response.json()["body"]["error"]["error"]["message"]
    assert "an RFC 3339 timestamp such as" in message and "$.sent_at" in message, message
    assert "regex" not in message


@pytest.mark.parametrize(
    "sent_at", ["2026-12-02T08:30:00Z", "2026-12-02T08:30:00.123456+01:00", "2026-12-02t08:30:00z"]
)
async def test_an_rfc_3339_sent_at_in_any_of_its_forms_is_accepted(http, sent_at):
    env = {
        **action_env(
            "msg_u" + str(len(sent_at)),
            "act_u",
            "cap:crewai:beta:knowledge_query",
            {"query": ["x"]},
            key="u" + str(len(sent_at)),
        ),
        "sent_at": sent_at,
    }
    response = await post(http, "acme-invoker", env)
    assert response.status_code in (200, 202), response.text


async def test_an_action_id_with_a_slash_is_refused_in_words_not_as_a_regex(http):
    env = action_env("msg_s", "../../etc", "cap:crewai:beta", {"topic": "x"}, key="s1")
    response = await post(http, "acme-invoker", env)
    assert response.status_code == 400, response.text
    message = response.json()["body"]["error"]["error"]["message"]
    assert "visible ASCII characters without '/'" in message and "regex" not in message, message


async def test_unauthenticated_message_is_401(http):
    response = await http.post("/aip/v1/messages", content=json.dumps(envelope()), headers=CT)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"


async def test_the_approval_list_filters_decided_ones_newest_first(http, clock):
    ids = []
    for n in range(3):
        ids.append((await submit_action(http, f"act_l{n}"))["approval_id"])
        clock.now += 1
    for approval_id, decision in ((ids[0], "approved"), (ids[2], "denied")):
        answer = await http.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-both"),
            json={"decision": decision, "reason": "r"},
        )
        assert answer.status_code == 200

    async def listed(query: str) -> list[str]:
        answer = await http.get(f"/aip/v1/approvals?{query}", headers=bearer("acme-both"))
        assert answer.status_code == 200, answer.text
        return [a["request"]["id"] for a in answer.json()["approvals"]]

    assert await listed("status=decided&order=newest") == [ids[2], ids[0]]
    assert await listed("status=decided") == [ids[0], ids[2]]
    assert await listed("status=pending") == [ids[1]]
    assert await listed("order=newest") == ids[::-1]
    first = await http.get("/aip/v1/approvals?order=newest&limit=1", headers=bearer("acme-both"))
    cursor = first.json()["cursor"]
    assert await listed(f"order=newest&limit=2&cursor={cursor}") == [ids[1], ids[0]]
    for query in ("status=decide", "status=", "status=PENDING", "order=desc", "order="):
        bad = await http.get(f"/aip/v1/approvals?{query}", headers=bearer("acme-both"))
        assert bad.status_code == 400, query
        error = bad.json()["body"]["error"]["error"]
        assert error["code"] == "message.invalid_envelope" and (
            "status must be" in error["message"] or "order must be" in error["message"]
        )


async def test_bad_cursors_are_typed(http):
    """(A pending action's stream stays open: tests/host/test_pending_streams.py.)"""
    env = action_env("msg_p", "act_p", "cap:crewai:beta", {"topic": "a"}, key="kp")
    assert (await post(http, "acme-invoker", env)).status_code == 202
    for value in ["abc", "-1", "sse_x"]:
        bad = await http.get("/aip/v1/actions/act_p/events", headers={**bearer("acme-invoker"), "Last-Event-ID": value})
        assert bad.status_code == 400 and bad.json()["body"]["error"]["error"]["code"] == "request.invalid_cursor"
    bad = await http.get("/aip/v1/actions/act_p/chunks?cursor=abc", headers=bearer("acme-invoker"))
    assert bad.json()["body"]["error"]["error"]["code"] == "request.invalid_cursor"


async def test_oversize_body_is_413_with_the_bound(http):
    response = await http.post(
        "/aip/v1/messages", content=b"x" * (2 * 1024 * 1024 + 1), headers={**CT, **bearer("acme-invoker")}
    )
    assert response.status_code == 413
    assert response.json()["body"]["error"]["error"]["code"] == "message.too_large"


async def test_cancel_needs_the_invoker_role(http):
    env = action_env("msg_c", "act_c", "cap:crewai:beta", {"topic": "a"}, key="kc")
    await post(http, "acme-invoker", env)
    denied = await http.post("/aip/v1/actions/act_c/cancel", headers=bearer("acme-operator"))
    assert denied.status_code == 403
    done = await http.post("/aip/v1/actions/act_c/cancel", headers=bearer("acme-invoker"))
    assert done.json()["body"]["action_result"]["status"] == "cancelled"


async def test_a_decision_reads_its_approval_and_action_in_one_hop_before_its_transaction(app_http, monkeypatch):
    """The route's checks and the revocation check share one read of the approval and its action."""
    from aip_crewai.host.http.state import host_state

    app, http = app_http
    env = action_env("msg_d", "act_d", "cap:crewai:beta", {"topic": "refunds"}, key="run-d")
    approval_id = (await post(http, "acme-invoker", env)).json()["body"]["action_result"]["output"]["approval_id"]
    calls = count_store_calls(host_state(app).store, monkeypatch)
    decided = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer("acme-both"),
        json={"decision": "approved", "reason": "ok"},
    )
    assert decided.status_code == 200, decided.text
    before = calls[: calls.index("_transaction_now")]  # the decision's one transaction
    # One read of both, plus at most one read by the host's reconciler if it woke meanwhile.
    assert before.count("read") == 1 and before.count("_fetch_now") <= 1, calls


async def test_a_reason_without_a_visible_character_is_refused_and_decides_nothing(http):
    approval_id = (await submit_action(http, "act_blank"))["approval_id"]
    url = f"/aip/v1/approvals/{approval_id}/decision"
    for reason in ("", "  ", "\n", "\u200b", "\u00a0", "\u202e\u202c"):
        refused = await http.post(url, headers=bearer("acme-both"), json={"decision": "approved", "reason": reason})
        assert refused.status_code == 400, (reason, refused.text)
        error = refused.json()["body"]["error"]["error"]
        assert error["code"] == "message.invalid_envelope" and "visible character" in error["message"], error
    still = await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))
    assert still.json()["status"] == "pending"
    decided = await http.post(url, headers=bearer("acme-both"), json={"decision": "denied", "reason": " \u200bno "})
    assert decided.status_code == 200, decided.text


async def test_a_decision_naming_a_member_twice_is_refused_and_decides_nothing(http):
    """``{"decision": "denied", "decision": "approved"}`` reads either way depending on the parser: refused,
    at any depth, so no decision (nor a signed body kept as its evidence) can mean two things."""
    approval_id = (await submit_action(http, "act_twice"))["approval_id"]
    url = f"/aip/v1/approvals/{approval_id}/decision"
    for body in (
        b'{"decision":"denied","decision":"approved","reason":"x"}',
        b'{"decision":"approved","reason":"x","reason":"y"}',
        b'{"decision":"approved","reason":"x","approver":{"id":"human:acme-both","id":"human:other"}}',
    ):
        refused = await http.post(url, headers={**bearer("acme-both"), **CT}, content=body)
        assert refused.status_code == 400, (body, refused.text)
        error = refused.json()["body"]["error"]["error"]
        assert error["code"] == "message.invalid_envelope" and "appears twice" in error["message"], error
    still = await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))
    assert still.json()["status"] == "pending"


async def test_the_same_decision_again_is_answered_as_recorded_and_any_other_is_409(http, clock):
    """A retry after a 503 whose commit went through, or after a lost answer, gets the decision as made."""
    approval_id = (await submit_action(http, "act_again"))["approval_id"]
    url = f"/aip/v1/approvals/{approval_id}/decision"
    body = {"decision": "approved", "reason": "checked"}
    first = await http.post(url, headers=bearer("acme-both"), json=body)
    assert first.status_code == 200, first.text
    clock.now += 5
    again = await http.post(url, headers=bearer("acme-both"), json=body)
    assert again.status_code == 200, again.text
    assert again.json() == first.json()  # decided_at included: the decision as it was recorded
    for other in ({"decision": "approved", "reason": "checked twice"}, {"decision": "denied", "reason": "checked"}):
        refused = await http.post(url, headers=bearer("acme-both"), json=other)
        assert refused.status_code == 409, (other, refused.text)
        assert refused.json()["body"]["error"]["error"]["code"] == "approval.already_decided"
