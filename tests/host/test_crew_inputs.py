"""Crew inputs from the sidecar's /health: schemas name them, submissions lacking one are 400."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, envelope, running

from aip_crewai.contracts.artifacts import input_schema
from aip_crewai.contracts.errors import InvalidInput
from aip_crewai.contracts.operations import get
from aip_crewai.host.crews.inputs import (
    MAX_PLACEHOLDERS,
    CrewInputs,
    check_crew_inputs,
    left_to_crew,
    parse_crew_inputs,
    project_input_schema,
)
from aip_crewai.host.http.approvals import MAX_REASON_NAMES, approval_reason
from aip_crewai.host.http.state import host_state

REQUIRED = CrewInputs(("customer", "topic"), defaults=False)
FILLED = CrewInputs(("customer", "topic"), defaults=True)


async def _submit(http: Any, name: str, capability_id: str, input: Any) -> Any:
    """``POST /aip/v1/messages`` of one action as ``acme-invoker``: action id ``act_<name>``, key ``k-<name>``."""
    env = envelope(f"msg_{name}")
    env["body"]["action"] = {
        "id": f"act_{name}",
        "capability_id": capability_id,
        "input": input,
        "idempotency_key": f"k-{name}",
    }
    return await http.post(
        "/aip/v1/messages",
        content=json.dumps(env),
        headers={"Content-Type": "application/aip+json", **bearer("acme-invoker")},
    )


def test_parse_keeps_well_formed_entries_only() -> None:
    parsed = parse_crew_inputs(
        {
            "a": {"placeholders": ["topic", "customer", "topic", "", 5, "x" * 257], "defaults": False},
            "b": {"placeholders": "topic", "defaults": False},
            "c": {"placeholders": ["t"], "defaults": "no"},
            "d": ["topic"],
        }
    )
    assert parsed == {"a": CrewInputs(("customer", "topic"), False)}
    assert parse_crew_inputs(None) == {} and parse_crew_inputs(["a"]) == {}
    many = parse_crew_inputs(
        {"a": {"placeholders": [f"n{i:04d}" for i in range(MAX_PLACEHOLDERS + 1)], "defaults": False}}
    )
    assert len(many["a"].placeholders) == MAX_PLACEHOLDERS


@pytest.mark.parametrize(
    "operation,input,path",
    [
        ("run", {"topic": "x"}, "$.customer"),
        ("batch_run", {"inputs": [{"topic": "x", "customer": "c"}, {"customer": "c"}]}, "$.inputs[1].topic"),
        ("train", {"n_iterations": 1, "artifact_name": "a"}, "$.inputs.customer"),
        ("test", {"n_iterations": 1, "inputs": {"customer": "c"}}, "$.inputs.topic"),
    ],
)
def test_a_missing_placeholder_is_named(operation, input, path) -> None:
    with pytest.raises(InvalidInput) as info:
        check_crew_inputs(operation, input, REQUIRED)
    assert info.value.details["field"] == path
    check_crew_inputs(operation, input, FILLED)  # the crew fills defaults: nothing required
    check_crew_inputs(operation, input, None)  # a peer sidecar reports nothing: nothing checked


def test_operations_without_kickoff_inputs_are_not_checked() -> None:
    for operation in ("replay", "status", "knowledge_query", "memory_reset"):
        check_crew_inputs(operation, {}, REQUIRED)


@given(st.dictionaries(st.sampled_from(["customer", "topic", "other"]), st.text(max_size=3)))
def test_check_agrees_with_the_projected_required_list(inputs) -> None:
    schema = project_input_schema(input_schema(get("run")), "run", REQUIRED)
    missing = [name for name in schema["required"] if name not in inputs]
    try:
        check_crew_inputs("run", inputs, REQUIRED)
    except InvalidInput:
        assert missing
    else:
        assert not missing


def test_schemas_name_the_placeholders_and_require_them_unless_defaults() -> None:
    run = project_input_schema(input_schema(get("run")), "run", REQUIRED)
    assert run["type"] == "object" and set(run["properties"]) == {"customer", "topic"}
    assert run["required"] == ["customer", "topic"]
    assert "required" not in project_input_schema(input_schema(get("run")), "run", FILLED)
    batch = project_input_schema(input_schema(get("batch_run")), "batch_run", REQUIRED)
    assert batch["properties"]["inputs"]["items"]["required"] == ["customer", "topic"]
    train = project_input_schema(input_schema(get("train")), "train", REQUIRED)
    assert "inputs" in train["required"] and train["properties"]["inputs"]["type"] == "object"
    assert project_input_schema(input_schema(get("run")), "run", None) == input_schema(get("run"))
    assert input_schema(get("run")).get("properties") is None  # the generic schema is not modified


async def test_through_the_host_the_manifest_and_the_fence_use_the_reported_inputs(make_app) -> None:
    fake = FakeSidecar(SIDECAR_TOKEN)
    fake.health["crew_inputs"] = {"beta": {"placeholders": ["topic"], "defaults": False}}
    app = make_app(sidecar_transport=fake.transport())
    async with running(app) as http:
        await host_state(app).readiness.refresh()
        manifest = (await http.get("/aip/v1/manifest", headers=bearer("acme-invoker"))).json()
        schemas = {cap["id"]: cap["input_schema"] for cap in manifest["capabilities"]}
        assert schemas["cap:crewai:beta"]["required"] == ["topic"]
        assert "required" not in schemas["cap:crewai:alpha"]  # not reported: the open schema
        refused = await _submit(http, "ci", "cap:crewai:beta", {"other": 1})
        approvals = await http.get("/aip/v1/approvals", headers=bearer("acme-both"))
    assert refused.status_code == 400
    error = refused.json()["body"]["error"]["error"]
    assert error["code"] == "action.invalid_input" and error["details"]["field"] == "$.topic"
    assert approvals.json()["approvals"] == []  # refused before any approval was requested


async def test_a_crew_the_sidecar_does_not_serve_is_refused_before_any_approval(make_app) -> None:
    """Issue 20 item 7: a warning names the crews; submissions to them are 503 capability.unavailable."""
    from structlog.testing import capture_logs

    fake = FakeSidecar(SIDECAR_TOKEN)
    fake.health.update({"crews": ["alpha", "gamma"], "operations": ["run"], "durable_journal": True})
    app = make_app(sidecar_transport=fake.transport())
    async with running(app) as http:
        with capture_logs() as logs:
            await host_state(app).readiness.refresh()
        refused = await _submit(http, "un", "cap:crewai:beta", {"topic": "t"})
        approvals = await http.get("/aip/v1/approvals", headers=bearer("acme-both"))
        accepted = await _submit(http, "ok", "cap:crewai:alpha", {})
    warnings = [e for e in logs if e["event"] == "crews_not_served"]
    assert warnings and warnings[0]["crews"] == ["beta"] and warnings[0]["log_level"] == "warning"
    assert refused.status_code == 503
    assert refused.json()["body"]["error"]["error"]["code"] == "capability.unavailable"
    assert approvals.json()["approvals"] == []
    assert accepted.status_code == 202  # a served crew still gets its approval request


def test_memory_domains_are_parsed_and_a_missing_domain_is_refused_naming_it() -> None:
    """a memory_reset of a domain the crew lacks is a typed 400 at $.command_type."""
    parsed = parse_crew_inputs(
        {
            "a": {"placeholders": [], "defaults": True, "memory_domains": ["knowledge", "memory", "bogus"]},
            "b": {"placeholders": [], "defaults": True, "memory_domains": "memory"},
            "c": {"placeholders": [], "defaults": True},
        }
    )
    assert parsed["a"].memory_domains == ("memory", "knowledge")  # known targets only, in their order
    assert parsed["b"].memory_domains is None and parsed["c"].memory_domains is None  # nothing is checked
    facts = CrewInputs((), True, ("kickoff_outputs", "knowledge"))
    with pytest.raises(InvalidInput) as refused:
        check_crew_inputs("memory_reset", {"command_type": "memory"}, facts)
    assert refused.value.field == "$.command_type"
    assert "no memory to reset" in refused.value.rule and "kickoff_outputs, knowledge; or all" in refused.value.rule
    for fine in ("knowledge", "kickoff_outputs", "all", "nonsense"):  # nonsense: the input type check names it
        check_crew_inputs("memory_reset", {"command_type": fine}, facts)
    check_crew_inputs("memory_reset", {"command_type": "memory"}, parsed["c"])  # not reported: not checked
    empty = CrewInputs((), True, ())
    with pytest.raises(InvalidInput, match="its memory domains: none"):
        check_crew_inputs("memory_reset", {"command_type": "knowledge"}, empty)


async def test_a_memory_reset_of_a_missing_domain_is_refused_at_submission_before_any_approval(make_app) -> None:
    fake = FakeSidecar(SIDECAR_TOKEN)
    fake.health["crew_inputs"] = {"beta": {"placeholders": [], "defaults": True, "memory_domains": ["knowledge"]}}
    app = make_app(sidecar_transport=fake.transport())
    async with running(app) as http:
        await host_state(app).readiness.refresh()

        refused = await _submit(http, "mr1", "cap:crewai:beta:memory_reset", {"command_type": "memory"})
        approvals = await http.get("/aip/v1/approvals", headers=bearer("acme-both"))
        accepted = await _submit(http, "mr2", "cap:crewai:beta:memory_reset", {"command_type": "knowledge"})
    error = refused.json()["body"]["error"]["error"]
    assert refused.status_code == 400 and error["code"] == "action.invalid_input"
    assert error["details"]["field"] == "$.command_type" and "its memory domains: knowledge" in error["message"]
    assert approvals.json()["approvals"] == [] and fake.executions == 0
    assert accepted.status_code == 202


@pytest.mark.parametrize(
    "operation,input,left",
    [
        ("run", {"topic": "x"}, ("customer",)),
        ("run", {"topic": "x", "customer": "c", "other": 1}, ()),
        ("batch_run", {"inputs": [{"topic": "x", "customer": "c"}, {"customer": "c"}]}, ("topic",)),
        ("train", {"n_iterations": 1, "artifact_name": "a"}, ("customer", "topic")),
        ("test", {"n_iterations": 1, "inputs": None}, ("customer", "topic")),
        ("test", {"n_iterations": 1, "inputs": {"customer": "c", "topic": "t"}}, ()),
        ("run", ["not", "an", "object"], ()),
        ("replay", {"task_id": "t"}, None),  # no kickoff inputs: the crew's callbacks do not run
        ("memory_reset", {"command_type": "all"}, None),
    ],
)
def test_what_a_crew_that_fills_defaults_may_do_to_the_inputs_is_named(operation, input, left) -> None:
    assert left_to_crew(operation, input, FILLED) == left
    assert left_to_crew(operation, input, REQUIRED) is None  # no callbacks: it runs what the input says
    assert left_to_crew(operation, input, None) is None  # its sidecar reported nothing


def test_a_reason_says_the_crew_may_change_the_inputs_and_names_those_left_out_within_its_bounds() -> None:
    plain = approval_reason("cap:crewai:beta")
    assert plain == "cap:crewai:beta changes crew state; the tenant's policy requires an approver's decision"
    may = approval_reason("cap:crewai:beta", ())
    assert may.startswith(plain + ". The crew's own code") and may.endswith("with values no approver sees")
    names = [f"n{i:02d}" for i in range(MAX_REASON_NAMES + 1)]
    at_bound = approval_reason("cap:crewai:beta", names[:MAX_REASON_NAMES])
    assert at_bound == f"{may}; this request leaves out {json.dumps(names[:MAX_REASON_NAMES], separators=(',', ':'))}"
    assert approval_reason("cap:crewai:beta", names).endswith('"n19"] and 1 more')
    # one name holding ", " and a quote, and a look-alike: a JSON array, escaped as the input would be
    odd = approval_reason("cap:crewai:beta", ['customer, "ticket"', "t\u043epic"])
    assert odd.endswith('leaves out ["customer, \\"ticket\\"","t\\u043epic"]')
    long = ["x" * 256] * 5  # 3 fit in the names' characters (MAX_REASON_NAME_CHARS), the first one always
    assert approval_reason("cap:crewai:beta", long).endswith('"] and 2 more')
    assert approval_reason("cap:crewai:beta", ["y" * 2000, "z"]).endswith(f'["{"y" * 2000}"] and 1 more')


async def test_an_approver_reading_the_approval_is_told_which_inputs_the_crew_fills_itself(make_app) -> None:
    """A crew with ``before_kickoff`` callbacks runs with values it sets for the inputs (those a request left
    out among them); the approval the approver reads says so and names them (before, it showed the input and
    nothing of the rest). An operator, who never reads the input, is told only that the crew may change it;
    the queue's pages keep the plain reason."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    fake.health["crew_inputs"] = {"beta": {"placeholders": ["customer", "ticket"], "defaults": True}}
    app = make_app(sidecar_transport=fake.transport())
    async with running(app) as http:
        await host_state(app).readiness.refresh()
        submitted = await _submit(http, "lf", "cap:crewai:beta", {"customer": "Dana"})
        (listed,) = (await http.get("/aip/v1/approvals", headers=bearer("acme-both"))).json()["approvals"]
        url = f"/aip/v1/approvals/{listed['request']['id']}"
        view = (await http.get(url, headers=bearer("acme-both"))).json()
        operator = (await http.get(url, headers=bearer("acme-operator"))).json()
    assert submitted.status_code == 202, submitted.text
    assert view["request"]["reason"] == approval_reason("cap:crewai:beta", ["ticket"])
    assert view["request"]["reason"].endswith('this request leaves out ["ticket"]')
    assert view["evidence_payload"]["input"] == {"customer": "Dana"}
    assert operator["request"]["reason"] == approval_reason("cap:crewai:beta", ())
    assert "evidence_payload" not in operator or operator["evidence_payload"] is None
    assert listed["request"]["reason"] == approval_reason("cap:crewai:beta")
