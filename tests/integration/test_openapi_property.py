"""The generated OpenAPI document against the real host: requests
schemathesis generates from the document, for every operation, get no 5xx and no
answer outside the document (status, content type, schema).

``make test`` runs the derandomized ``ci`` profile with :data:`EXAMPLES` requests
per operation; ``make chaos`` runs this file with ``HYPOTHESIS_PROFILE=explore``
and ``AIP_CREWAI_API_EXAMPLES`` (random draws, many more requests).
"""

from __future__ import annotations

import os

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis needs Python 3.11+ (pyproject.toml)")
from kits.host import TOKENS, start_host  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from aip_crewai.host.http import openapi  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.host_processes]

EXAMPLES = int(os.environ.get("AIP_CREWAI_API_EXAMPLES", "30"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
SCHEMA = schemathesis.openapi.from_dict(openapi.document())
#: Endless by design (the approval stream never ends by itself): its frames are tested in
#: tests/host/test_approval_stream.py.
ENDLESS = {("GET", "/aip/v1/approvals/events")}
CREDENTIAL_HEADERS = {"authorization", "signature", "signature-input", "content-digest"}
#: The action and approval the ``existing`` runs name (filled by the ``host`` fixture).
KNOWN: dict[str, str] = {}
OPERATIONS = sorted(
    (method.upper(), path)
    for path, item in openapi.document()["paths"].items()
    for method in item
    if (method.upper(), path) not in ENDLESS
)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    from kits.sidecar import SidecarFactory

    root = tmp_path_factory.mktemp("openapi")
    root.chmod(0o700)
    factory = SidecarFactory(root)
    try:
        sidecar = factory.start()
        served = start_host(root / "host", sidecar.base_url, sidecar.token)
        try:
            with served.client("acme-app") as app:
                done = app.call("cap:crewai:knowledge_a:knowledge_query", {"query": ["lamp"]}, idempotency_key="oa-1")
                pending = app.call("cap:crewai:echo", {"topic": "openapi"}, idempotency_key="oa-2")
            KNOWN["action_id"] = done["body"]["action_result"]["action_id"]
            KNOWN["approval_id"] = pending["body"]["action_result"]["output"]["approval_id"]
            yield served
        finally:
            served.stop()
    finally:
        factory.close()


def test_the_served_document_is_the_generated_one(host):
    served = httpx2.get(f"{host.base_url}/openapi.json", timeout=30)
    assert served.status_code == 200 and served.json() == openapi.document()
    assert served.json()["openapi"] == "3.1.0"


@pytest.mark.parametrize(
    "method, path, ids",
    [
        *((method, path, "drawn") for method, path in OPERATIONS),
        *((method, path, "existing") for method, path in OPERATIONS if "_id}" in path),
    ],
)
def test_generated_requests_get_no_5xx_and_only_documented_answers(host, method, path, ids):
    """``drawn``: every part drawn from the document; ``existing``: the path names an action
    (a completed knowledge_query) or approval (pending) that exists, the rest drawn."""
    names = [name for name in ("action_id", "approval_id") if "{" + name + "}" in path]
    principal = "acme-approver" if "/approvals" in path else "acme-app"
    headers = {"Authorization": f"Bearer {TOKENS[principal]}"}
    fixed = {name: KNOWN[name] for name in names} if ids == "existing" else None
    operation = SCHEMA[path][method]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
    )
    @given(case=operation.as_strategy(path_parameters=fixed))
    def check(case):
        # The document's security schemes make schemathesis draw credentials of its own (a random
        # Signature header or stream_token), which are refused (401, tested in tests/host): the
        # principal's token goes in their place, so the generated requests reach the handlers.
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() not in CREDENTIAL_HEADERS}
        case.query = {k: v for k, v in (case.query or {}).items() if k != "stream_token"}
        response = case.call(base_url=host.base_url, headers=headers, timeout=60)
        case.validate_response(response, checks=CHECKS)

    check()
