"""Canonical hashing, the error catalogue, and drift of generated artifacts."""

import hashlib
import json
from pathlib import Path

import pytest

from aip_crewai.contracts import artifacts
from aip_crewai.contracts.artifacts import inline_root, input_schema
from aip_crewai.contracts.errors import (
    AipError,
    Category,
    ConnectorExecutionFailed,
    ConnectorTransport,
    all_error_classes,
)
from aip_crewai.contracts.hashing import canonical_json, jcs, request_hash
from aip_crewai.contracts.operations import CATALOGUE

ROOT = Path(__file__).resolve().parents[2]


def test_canonical_json_sorted_compact_utf8():
    assert canonical_json({"b": "é", "a": [1, {"d": 1, "c": 2}]}) == '{"a":[1,{"c":2,"d":1}],"b":"é"}'.encode()


def test_request_hash_is_sha256_of_canonical_fields():
    fields = dict(crew_id="c", action_id="a", operation="run", input={"x": 1}, timeout_ms=None, idempotency_key="k")
    expected = hashlib.sha256(canonical_json(fields)).hexdigest()
    assert request_hash(**fields) == expected
    assert request_hash(**{**fields, "input": {"x": 2}}) != expected


def test_jcs_is_rfc8785():
    assert jcs({"b": 1, "a": 1.0}) == b'{"a":1,"b":1}'


def test_every_error_class_has_a_unique_code_and_status():
    classes = all_error_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        status = (
            cls.http_status
            if cls.http_status is not None
            else {
                Category.AUTH: 401,
                Category.POLICY: 403,
                Category.TEMPORARY: 503,
                Category.TRANSPORT: 503,
                Category.CONNECTOR: 502,
                Category.ECONOMIC: 402,
                Category.PERMANENT: 400,
            }[cls.category]
        )
        assert 400 <= status < 600


def test_connector_errors_carry_details_and_retry_only_read_only_transport():
    err = ConnectorTransport(operation="status", read_only=True, dispatch="not_sent")
    assert err.details == {
        "operation": "status",
        "remote_status": None,
        "uncertain_outcome": False,
        "dispatch": "not_sent",
    }
    assert err.retryable and err.status == 503
    assert not ConnectorTransport(operation="run", read_only=False).retryable
    assert not ConnectorExecutionFailed(operation="status", read_only=True).retryable
    assert isinstance(err, AipError)


def test_committed_artifacts_match_the_code():
    drift = artifacts.check(ROOT / "contracts")
    assert drift == [], f"regenerate with `aip-crewai contracts --write`: {drift}"


def test_capabilities_document_counts_first():
    doc = artifacts.capabilities_document()
    assert list(doc)[:3] == ["connector_profile", "crewai_package", "counts"]
    assert [r["operation"] for r in doc["operations"]][0] == "run"
    assert doc["operations"][0]["capability_template"] == "cap:crewai:<crew_id>"


@pytest.mark.parametrize("spec", CATALOGUE, ids=lambda s: s.name)
def test_every_input_schema_is_an_object_at_its_root(spec) -> None:
    """Tool-calling clients need ``type: object`` at the top, never a root ``$ref``."""
    schema = input_schema(spec)
    assert schema["type"] == "object" and "$ref" not in schema
    assert all(f"#/$defs/{name}" in json.dumps(schema) for name in schema.get("$defs", {}))  # no unused defs


def test_inline_root_keeps_definitions_still_referred_to() -> None:
    node = {"type": "object", "properties": {"child": {"$ref": "#/$defs/Node"}, "leaf": {"$ref": "#/$defs/Leaf"}}}
    schema = {"$ref": "#/$defs/Node", "$defs": {"Node": node, "Leaf": {"type": "string"}, "Unused": {}}}
    inlined = inline_root(schema)
    assert inlined["type"] == "object" and "$ref" not in inlined
    assert set(inlined["$defs"]) == {"Node", "Leaf", "Unused"}  # Node is recursive: kept
    flat = inline_root({"$ref": "#/$defs/A", "$defs": {"A": {"type": "object"}}})
    assert flat == {"type": "object"}
    assert inline_root({"type": "object"}) == {"type": "object"}
