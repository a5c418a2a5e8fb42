"""The catalogue is the seed's table, and resolution follows ARCHITECTURE.md §3."""

import pytest

from aip_crewai.contracts import operations as ops


def test_aggregate_counts_match_the_seed():
    assert ops.aggregate_counts() == {
        "operations": 10,
        "risk": {"low": 3, "medium": 5, "high": 2},
        "approval_required": 7,
        "idempotency_key_required": 8,
        "streaming": 6,
        "cancellable": 5,
    }


def test_published_order_and_rows():
    rows = {
        (s.name, s.kind.value, s.risk.value, s.mutation, s.approval, s.key.value, s.stream, s.cancel, s.retry)
        for s in ops.CATALOGUE
    }
    assert ops.OPERATION_NAMES == (
        "run",
        "status",
        "events",
        "cancel",
        "batch_run",
        "replay",
        "train",
        "test",
        "knowledge_query",
        "memory_reset",
    )
    assert ("run", "agent", "medium", True, True, "required", True, True, False) in rows
    assert ("status", "tool", "low", False, False, "optional", False, False, True) in rows
    assert ("events", "tool", "low", False, False, "optional", True, False, True) in rows
    assert ("cancel", "tool", "medium", True, True, "required", False, False, False) in rows
    assert ("train", "workflow", "high", True, True, "required", True, True, False) in rows
    assert ("knowledge_query", "tool", "low", False, False, "required", False, False, True) in rows
    assert ("memory_reset", "tool", "high", True, True, "required", False, False, False) in rows


def test_sidecar_routes():
    assert ops.get("status").path == "/jobs/{run_action_id}"
    assert ops.get("events").stream_path == "/jobs/{run_action_id}/events"
    assert ops.get("cancel").path == "/jobs/{run_action_id}/cancel"
    assert ops.get("replay").stream_path == "/jobs/stream"
    assert ops.INSPECTION_OPERATIONS == {"status", "events", "cancel"}
    assert set(ops.STARTABLE_OPERATIONS) == set(ops.OPERATION_NAMES) - ops.INSPECTION_OPERATIONS


def test_side_effects_by_mutation():
    assert ops.get("run").side_effects == ("read", "write", "external_network", "code_execution")
    assert ops.get("status").side_effects == ("read", "external_network")


def test_capability_ids_never_append_run():
    assert ops.capability_id("support-primary", "run") == "cap:crewai:support-primary"
    assert ops.capability_id("support-primary", "status") == "cap:crewai:support-primary:status"
    with pytest.raises(KeyError):
        ops.capability_id("x", "nope")


ALL = set(ops.OPERATION_NAMES)


@pytest.mark.parametrize(
    ("cap", "allowed", "expected"),
    [
        ("cap:crewai:a", {"a": ALL}, ("a", "run")),
        ("cap:crewai:a:status", {"a": ALL}, ("a", "status")),
        ("cap:crewai:a:run", {"a": ALL}, None),
        ("cap:crewai:a:nope", {"a": ALL}, None),
        ("cap:crewai:a:train", {"a": {"run", "status"}}, None),
        ("cap:crewai:a", {"a": {"status"}}, None),
        ("cap:crewai:b", {"a": ALL}, None),
        ("cap:other:a", {"a": ALL}, None),
        ("cap:crewai:", {"a": ALL}, None),
        # longest crew id wins; an exact id means run
        ("cap:crewai:a:b:status", {"a": ALL, "a:b": ALL}, ("a:b", "status")),
        ("cap:crewai:a:b", {"a": ALL, "a:b": ALL}, ("a:b", "run")),
        ("cap:crewai:a:status", {"a": {"run"}, "a:status": ALL}, ("a:status", "run")),
    ],
)
def test_resolve_capability(cap, allowed, expected):
    assert ops.resolve_capability(cap, allowed) == expected
