"""Descriptor admission: every rule of ARCHITECTURE.md §7, errors naming index and id."""

from __future__ import annotations

import json

import pytest

from aip_crewai.contracts.operations import LEGACY_DEFAULT_OPERATIONS, OPERATION_NAMES, resolve_capability
from aip_crewai.host.crews.descriptors import AdmissionError, check_crew_id, load_descriptors


def load(items) -> tuple:
    return load_descriptors(json.dumps(items).encode())


def failure(items) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        load(items)
    return info.value


def test_missing_allowed_operations_means_the_legacy_default():
    (crew,) = load([{"id": "support-primary", "name": "Support"}])
    assert crew.allowed_operations == LEGACY_DEFAULT_OPERATIONS == ("run", "status", "events", "cancel")
    assert crew.legacy and crew.description is None


def test_explicit_subset_is_exactly_that_subset_in_catalogue_order():
    (crew,) = load([{"id": "c", "name": "C", "allowed_operations": ["memory_reset", "status", "run"]}])
    assert crew.allowed_operations == ("run", "status", "memory_reset") and not crew.legacy


def test_all_ten_operations():
    (crew,) = load([{"id": "c", "name": "C", "allowed_operations": list(reversed(OPERATION_NAMES))}])
    assert crew.allowed_operations == OPERATION_NAMES


def test_empty_allowed_operations_fails():
    err = failure([{"id": "c", "name": "C", "allowed_operations": []}])
    assert err.index == 0 and err.crew_id == "c" and err.field == "allowed_operations"
    assert err.message.startswith("[0] (id 'c').allowed_operations: must not be empty")


def test_unknown_operation_fails_naming_position():
    err = failure([{"id": "a", "name": "A"}, {"id": "b", "name": "B", "allowed_operations": ["run", "explode"]}])
    assert (err.index, err.crew_id, err.field) == (1, "b", "allowed_operations[1]")
    assert "'explode'" in err.message


def test_duplicate_operation_fails():
    assert failure([{"id": "c", "name": "C", "allowed_operations": ["run", "run"]}]).field == "allowed_operations[1]"


def test_duplicate_ids_fail_naming_both_positions():
    err = failure([{"id": "a", "name": "A"}, {"id": "b", "name": "B"}, {"id": "a", "name": "A2"}])
    assert (err.index, err.crew_id) == (2, "a") and "[0]" in err.message


@pytest.mark.parametrize("count", [0, 1001])
def test_crew_count_bounds(count):
    err = failure([{"id": f"c{i}", "name": "C"} for i in range(count)])
    assert "1..1000" in err.message and err.index is None


def test_one_thousand_crews_are_admitted():
    assert len(load([{"id": f"c{i}", "name": "C"} for i in range(1000)])) == 1000


@pytest.mark.parametrize(
    "crew_id",
    [
        "",
        "x" * 257,
        "has space",
        "slash/id",
        "tab\tid",
        "nl\n",
        "é",
        ":lead",
        "trail:",
        "dou::ble",
        "-dash-first",
        "a:status",
        "a:run",
        "x:y:memory_reset",
        "\u0085",
    ],
)
def test_invalid_ids_fail(crew_id):
    err = failure([{"id": crew_id, "name": "C"}])
    assert err.field == "id" and err.index == 0 and err.crew_id == crew_id


@pytest.mark.parametrize(
    "crew_id", ["a", "support-primary", "x" * 256, "team.a_b-c", "ns:crew", "a:b:c", "status", "run", "status:x"]
)
def test_valid_ids(crew_id):
    assert check_crew_id(crew_id) is None
    assert load([{"id": crew_id, "name": "C"}])[0].id == crew_id


def test_colon_ids_stay_unambiguous_with_longest_match():
    crews = load(
        [
            {"id": "ns", "name": "N", "allowed_operations": list(OPERATION_NAMES)},
            {"id": "ns:crew", "name": "NC", "allowed_operations": list(OPERATION_NAMES)},
        ]
    )
    allowed = {c.id: c.allowed_operations for c in crews}
    assert resolve_capability("cap:crewai:ns:crew", allowed) == ("ns:crew", "run")
    assert resolve_capability("cap:crewai:ns:crew:status", allowed) == ("ns:crew", "status")
    assert resolve_capability("cap:crewai:ns:status", allowed) == ("ns", "status")


@pytest.mark.parametrize(("name", "ok"), [("", False), ("n" * 512, True), ("n" * 513, False), ("a\nb", False)])
def test_name_bounds(name, ok):
    items = [{"id": "c", "name": name}]
    if ok:
        assert load(items)[0].name == name
    else:
        assert failure(items).field == "name"


def test_description_is_bounded_in_utf8_bytes():
    assert load([{"id": "c", "name": "C", "description": "é" * 8192}])[0].description == "é" * 8192  # 16384 bytes
    assert failure([{"id": "c", "name": "C", "description": "é" * 8192 + "x"}]).field == "description"


def test_unknown_descriptor_fields_are_rejected():
    """A misspelt allowed_operations must not silently fall back to the legacy default."""
    err = failure([{"id": "c", "name": "C", "allowed_operation": ["run"]}])
    assert err.field == "allowed_operation" and err.crew_id == "c" and "unknown field" in err.message


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"name": "C"}, None),
        ({"id": 5, "name": "C"}, "id"),
        ({"id": "c", "name": "C", "allowed_operations": "run"}, "allowed_operations"),
        ("c", None),
    ],
)
def test_wrong_shapes_fail_with_the_index(item, field):
    err = failure([{"id": "ok", "name": "OK"}, item])
    assert err.index == 1
    if field:
        assert err.field == field


@pytest.mark.parametrize("data", [b"{}", b"not json", b'{"id": "c"}', b"\xff"])
def test_file_must_be_a_json_array(data):
    with pytest.raises(AdmissionError):
        load_descriptors(data)
