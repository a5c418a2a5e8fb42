"""The tenant-scoped manifest: counts, per-capability contract against the seed
table, bindings, schemas, default-deny routing (ARCHITECTURE.md §6, §7)."""

from __future__ import annotations

import msgspec
import pytest
from kits.hostapp import bearer

from aip_crewai.contracts.aip import Manifest
from aip_crewai.contracts.artifacts import input_schema
from aip_crewai.contracts.errors import CapabilityNotFound
from aip_crewai.contracts.operations import get
from aip_crewai.host.crews.descriptors import CrewDescriptor, load_descriptors
from aip_crewai.host.crews.manifest import CapabilityIndex, crew_capabilities, to_wire

# docs/reference/http-api.md "Capabilities" "Compare all operations" (restated here on purpose: the test checks the code).
SEED = {
    # op: (kind, risk, mutation, approval, key, stream, cancel, retry)
    "run": ("agent", "medium", True, True, "required", True, True, False),
    "status": ("tool", "low", False, False, "optional", False, False, True),
    "events": ("tool", "low", False, False, "optional", True, False, True),
    "cancel": ("tool", "medium", True, True, "required", False, False, False),
    "batch_run": ("agent", "medium", True, True, "required", True, True, False),
    "replay": ("agent", "medium", True, True, "required", True, True, False),
    "train": ("workflow", "high", True, True, "required", True, True, False),
    "test": ("workflow", "medium", True, True, "required", True, True, False),
    "knowledge_query": ("tool", "low", False, False, "required", False, False, True),
    "memory_reset": ("tool", "high", True, True, "required", False, False, False),
}
ROUTES = {  # docs/reference/http-api.md "Capabilities" "Interpret methods and fixed sidecar paths"
    "run": ("POST", "/jobs", "/jobs/stream"),
    "status": ("GET", "/jobs/{run_action_id}", None),
    "events": ("GET", "/jobs/{run_action_id}/events", "/jobs/{run_action_id}/events"),
    "cancel": ("POST", "/jobs/{run_action_id}/cancel", None),
    "batch_run": ("POST", "/jobs", "/jobs/stream"),
    "replay": ("POST", "/jobs", "/jobs/stream"),
    "train": ("POST", "/jobs", "/jobs/stream"),
    "test": ("POST", "/jobs", "/jobs/stream"),
    "knowledge_query": ("POST", "/jobs", None),
    "memory_reset": ("POST", "/jobs", None),
}
FULL = CrewDescriptor("support-primary", "Support", None, tuple(SEED))
LEGACY = load_descriptors(b'[{"id": "legacy", "name": "Legacy"}]')[0]


def by_op(crew: CrewDescriptor) -> dict[str, dict]:
    caps = to_wire(crew_capabilities(crew))
    return {cap["id"].removeprefix(f"cap:crewai:{crew.id}").lstrip(":") or "run": cap for cap in caps}


def test_fully_enabled_crew_publishes_ten_in_catalogue_order():
    caps = crew_capabilities(FULL)
    assert [c.id for c in caps] == ["cap:crewai:support-primary"] + [
        f"cap:crewai:support-primary:{op}" for op in list(SEED)[1:]
    ]
    assert not any(c.id.endswith(":run") for c in caps)


def test_legacy_crew_publishes_four():
    assert [c.id for c in crew_capabilities(LEGACY)] == [
        "cap:crewai:legacy",
        "cap:crewai:legacy:status",
        "cap:crewai:legacy:events",
        "cap:crewai:legacy:cancel",
    ]


def test_seed_counts_over_a_full_crew():
    caps = to_wire(crew_capabilities(FULL))
    assert [sum(c["risk"] == r for c in caps) for r in ("low", "medium", "high")] == [3, 5, 2]
    assert sum(c["requires_human_approval"] for c in caps) == 7
    assert sum(c["contract"]["idempotency"]["requirement"] == "required" for c in caps) == 8
    assert sum(c["contract"]["execution"]["supports_streaming"] for c in caps) == 6
    assert sum(c["contract"]["execution"]["supports_cancel"] for c in caps) == 5


@pytest.mark.parametrize("op", list(SEED))
def test_each_capability_matches_the_seed_row(op):
    kind, risk, mutation, approval, key, stream, cancel, retry = SEED[op]
    cap = by_op(FULL)[op]
    spec = get(op)
    assert cap["name"] == f"CrewAI Support: {spec.display_name}"
    assert (cap["kind"], cap["risk"], cap["requires_human_approval"]) == (kind, risk, approval)
    contract = cap["contract"]
    assert contract["idempotency"] == {
        "requirement": key,
        "collision_behavior": "revalidate_input_hash",
        "key_scope": "tenant",
        "ttl_ms": 86_400_000,
    }
    assert contract["execution"] == {
        "supports_sync": True,
        "supports_async": True,
        "supports_streaming": stream,
        "supports_cancel": cancel,
        "supports_retry": retry,
        "expected_completion": "streaming" if stream else "sync",
        "retry_safety": "safe_with_idempotency_key" if mutation else "safe",
    }
    assert contract["data"] == {"sensitivity": "confidential", "contains_pii": True, "redaction_required": True}
    if mutation:
        assert contract["side_effects"] == ["read", "write", "external_network", "code_execution"]
        assert contract["approval"] == {
            "required": True,
            "approver_selector": {"type": "tenant_policy"},
            "ttl_ms": 900_000,
            "evidence_requirements": ["reason", "input_snapshot", "policy_decision"],
        }
        assert contract["compensation"] == {"mode": "rollback_not_supported", "requires_approval": False}
    else:
        assert contract["side_effects"] == ["read", "external_network"]
        assert "approval" not in contract and "compensation" not in contract
    method, path, stream_path = ROUTES[op]
    native, binding = cap["bindings"]
    assert native == {
        "profile": "aip.native.http.v1",
        "method": "POST",
        "path": "/aip/v1/messages",
        "message_type": "aip.core.v1.action",
    }
    assert (binding["profile"], binding["method"], binding["path"], binding.get("stream_path")) == (
        "aip.connector.crewai.v1",
        method,
        path,
        stream_path,
    )
    assert cap["input_schema"] == input_schema(spec)


def test_output_schemas_follow_design_outputs():
    caps = by_op(FULL)
    run = caps["run"]["output_schema"]
    assert set(run["required"]) == {"raw", "token_usage", "tasks_output"}
    assert {"json_dict", "pydantic"} <= set(run["properties"])
    assert "task_id" in run["properties"]["tasks_output"]["items"]["required"]
    assert caps["replay"]["output_schema"]["properties"] == run["properties"]
    assert set(caps["batch_run"]["output_schema"]["required"]) == {"results", "count"}
    assert set(caps["train"]["output_schema"]["required"]) == {"status", "artifact_name", "n_iterations"}
    assert "scores" in caps["test"]["output_schema"]["properties"]
    assert caps["knowledge_query"]["output_schema"]["required"] == ["results"]
    reset = caps["memory_reset"]["output_schema"]
    assert set(reset["required"]) == {"status", "command_type"} and "reset_targets" in reset["properties"]
    job_view = {"action_id", "crew_id", "operation", "status", "event_count"}
    assert set(caps["status"]["output_schema"]["required"]) == job_view
    assert set(caps["cancel"]["output_schema"]["required"]) == job_view
    assert set(caps["events"]["output_schema"]["required"]) == {
        "action_id",
        "cursor",
        "next_cursor",
        "status",
        "events",
    }
    assert all(c["output_schema"]["$schema"].endswith("2020-12/schema") for c in caps.values())


def test_each_capability_says_what_its_operation_does_and_the_crew_description_comes_once():
    crew = CrewDescriptor("c", "C", "does things", ("run", "status", "events"))
    run, status, events = crew_capabilities(crew)
    assert run.description == "Run crew 'c' once with the given inputs (its CrewAI kickoff inputs). does things"
    assert status.description == get("status").describe("c")
    assert events.description == get("events").describe("c")
    described = [cap.description for cap in crew_capabilities(FULL)]
    assert described == [get(name).describe("support-primary") for name in SEED]  # no crew description: none added


def test_without_run_the_crew_description_goes_on_its_first_capability():
    crew = CrewDescriptor("c", "C", "does things", ("status", "knowledge_query"))
    first, second = crew_capabilities(crew)
    assert first.description == get("status").describe("c") + " does things"
    assert second.description == get("knowledge_query").describe("c")


def test_no_schema_text_in_the_manifest_holds_doc_markup():
    index = CapabilityIndex([FULL], {"t": ["support-primary"]})
    encoded = index.manifest_bytes("t").decode()
    assert "``" not in encoded and ":class:" not in encoded and "`" not in encoded
    manifest = msgspec.json.decode(encoded)
    status = next(cap for cap in manifest["capabilities"] if cap["id"].endswith(":status"))
    assert status["input_schema"]["description"] == "status: read one job's status."


# --- tenant scoping -------------------------------------------------------------


def index() -> CapabilityIndex:
    crews = load_descriptors(
        b'[{"id": "a", "name": "A"}, {"id": "b", "name": "B", "allowed_operations": ["run"]},'
        b' {"id": "a:x", "name": "AX", "allowed_operations": ["run", "status"]}]'
    )
    return CapabilityIndex(crews, {"t1": ["a", "a:x"], "t2": ["b"], "closed": []})


def test_manifests_are_tenant_scoped_and_built_once():
    idx = index()
    assert idx.manifest_bytes("t1") is idx.manifest_bytes("t1")
    t1 = idx.manifest("t1")
    assert (t1.manifest_version, t1.profiles, t1.agent.id) == (
        "aip-manifest/v1",
        ["aip.native.http.v1", "aip.connector.crewai.v1", "aip.sse.stream.v1"],
        "aip-crewai-host",
    )
    assert [c.id for c in t1.capabilities] == [
        "cap:crewai:a",
        "cap:crewai:a:status",
        "cap:crewai:a:events",
        "cap:crewai:a:cancel",
        "cap:crewai:a:x",
        "cap:crewai:a:x:status",
    ]
    assert [c.id for c in idx.manifest("t2").capabilities] == ["cap:crewai:b"]
    assert idx.manifest("closed").capabilities == [] and idx.manifest("nobody").capabilities == []


def test_default_deny_another_tenants_crew_is_not_found_like_an_unknown_one():
    idx = index()
    assert idx.resolve("t1", "cap:crewai:a:x:status").crew.id == "a:x"
    assert idx.resolve("t2", "cap:crewai:b").spec.name == "run"
    errors = []
    for tenant, cap in [
        ("t2", "cap:crewai:a"),
        ("t1", "cap:crewai:b"),
        ("t1", "cap:crewai:zzz"),
        ("t1", "cap:crewai:a:train"),
        ("closed", "cap:crewai:a"),
        ("t1", "cap:crewai:a:run"),
    ]:
        with pytest.raises(CapabilityNotFound) as info:
            idx.resolve(tenant, cap)
        errors.append((info.value.code, info.value.status))
        # the same words whether the crew exists for another tenant or not: the id asked for and the manifest
        assert info.value.message.startswith(f'capability "{cap}" not found;')
        assert info.value.message.endswith(
            "`aip-crewai manifest` (GET /aip/v1/manifest) lists the ids this tenant may call"
        )
        assert info.value.details == {"capability_id": cap}
    assert set(errors) == {("capability.not_found", 404)}


# --- routes -----------------------------------------------------------------------


async def test_manifest_route_serves_the_callers_tenant(client):
    response = await client.get("/aip/v1/manifest", headers=bearer("acme-invoker"))
    assert response.status_code == 200 and response.headers["content-type"] == "application/aip+json"
    run = response.json()["capabilities"][0]
    assert run["contract"]["idempotency"]["collision_behavior"] == "revalidate_input_hash"  # defaults on the wire
    assert run["contract"]["approval"]["approver_selector"] == {"type": "tenant_policy"}
    manifest = msgspec.json.decode(response.content, type=Manifest)
    assert len(manifest.capabilities) == 4 + 10
    assert not any(c.id.startswith("cap:crewai:gamma") for c in manifest.capabilities)
    same = await client.get("/aip/v1/capabilities", headers=bearer("acme-invoker"))
    assert same.content == response.content


async def test_other_tenants_see_only_their_crews(client):
    globex = (await client.get("/aip/v1/manifest", headers=bearer("globex-invoker"))).json()
    assert [c["id"] for c in globex["capabilities"]] == ["cap:crewai:gamma"]
    closed = (await client.get("/aip/v1/manifest", headers=bearer("closed-invoker"))).json()
    assert closed["capabilities"] == []


async def test_any_role_of_the_tenant_may_read(client):
    response = await client.get("/aip/v1/manifest", headers=bearer("acme-operator"))
    assert response.status_code == 200 and len(response.json()["capabilities"]) == 4 + 10
