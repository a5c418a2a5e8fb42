"""The generated OpenAPI 3.1 document: every route documented, every
schema from the msgspec types, served at /openapi.json unless ``[host] openapi = false``.
The property test against the real host is tests/integration/test_openapi_property.py."""

from __future__ import annotations

import dataclasses

import msgspec
from kits.hostapp import running

from aip_crewai.contracts.aip import ApprovalDecision, Envelope
from aip_crewai.host.http import openapi


def test_every_route_of_the_app_is_documented_and_nothing_else(make_app):
    assert openapi.undocumented(make_app().routes) == set()


def test_schemas_are_the_types_schemas():
    doc = openapi.document()
    _, components = msgspec.json.schema_components(
        [Envelope, ApprovalDecision], ref_template="#/components/schemas/{name}"
    )
    for name in ("Envelope", "ApprovalDecision", "Body", "ProtocolError"):
        assert doc["components"]["schemas"][name] == components[name]
    decision = doc["paths"]["/aip/v1/approvals/{approval_id}/decision"]["post"]
    assert decision["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/DecisionRequest"
    }
    assert decision["responses"]["4XX"]["content"]["application/aip+json"]["schema"] == {
        "$ref": "#/components/schemas/Envelope"
    }


def test_the_document_is_openapi_3_1_and_the_same_every_time():
    first, second = openapi.document(), openapi.document()
    assert first == second and first["openapi"] == "3.1.0"
    assert set(first["components"]["securitySchemes"]) == {"bearer", "httpSignature", "streamToken"}
    events = first["paths"]["/aip/v1/actions/{action_id}/events"]["get"]
    assert {"streamToken": []} in events["security"] and "204" in events["responses"]
    assert first["paths"]["/health"]["get"]["security"] == []


async def test_it_is_served_without_credentials_and_can_be_switched_off(make_app, settings):
    async with running(make_app()) as http:
        served = await http.get("/openapi.json")
    assert served.status_code == 200 and served.json() == openapi.document()
    async with running(make_app(dataclasses.replace(settings, openapi=False))) as http:
        assert (await http.get("/openapi.json")).status_code == 404


def test_starlette_paths_become_openapi_paths():
    assert openapi.openapi_path("/aip/v1/actions/{action_id:str}/events") == "/aip/v1/actions/{action_id}/events"


def test_the_committed_document_matches_the_code():
    from pathlib import Path

    rel, text = openapi.artifact()
    committed = Path(__file__).resolve().parents[2] / "contracts" / rel
    assert committed.read_text(encoding="utf-8") == text, "run `aip-crewai contracts --write`"
