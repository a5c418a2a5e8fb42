"""The receipt, key and usage routes and the receipt chains of the views, in-process
(host/ledger/routes.py, docs/observing.md "Observing actions")."""

import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kits.hostapp import NOW, bearer, running

from aip_crewai.contracts.aip import ActionResult
from aip_crewai.host.http.state import host_state
from aip_crewai.host.ledger import receipts as rc
from aip_crewai.host.store.store import ms_to_rfc3339

KEY = Ed25519PrivateKey.from_private_bytes(b"\x0a" * 32)
OLD = Ed25519PrivateKey.from_private_bytes(b"\x0b" * 32)
USAGE = {"total_tokens": 15, "prompt_tokens": 10, "completion_tokens": 5, "successful_requests": 1}


@pytest.fixture
def app(make_app, settings):
    return make_app(dataclasses.replace(settings, receipt_keys=rc.ReceiptKeys(KEY, (OLD.public_key(),))))


async def finish_run(app, action_id="act_1", tenant="acme", crew="beta"):
    """Store a completed run of ``crew`` for ``tenant`` (as the dispatch would), returning its stored result."""
    writer = host_state(app).actions.writer
    result = ActionResult(action_id=action_id, status="completed", output={"raw": "ok", "token_usage": USAGE})
    _, record = await writer.write_answered(
        writer.answered(
            tenant,
            action_id,
            f"cap:crewai:{crew}",
            crew,
            "run",
            "{}",
            "ab" * 32,
            f"{tenant}-invoker",
            result,
            "acknowledged",
        )
    )
    return json.loads(record.result_json)


async def test_the_receipt_route_returns_the_signed_bytes_to_the_tenant_only(app):
    async with running(app) as http:
        result = await finish_run(app)
        ref = result["receipt"]
        answer = await http.get(f"/aip/v1/receipts/{ref['id']}", headers=bearer("acme-operator"))
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
        assert rc.verify(answer.content, [KEY.public_key()])["action_id"] == "act_1"
        assert json.loads(answer.content)["hash"] == ref["hash"]
        foreign = await http.get(f"/aip/v1/receipts/{ref['id']}", headers=bearer("globex-invoker"))
        assert foreign.status_code == 404 and foreign.json()["body"]["error"]["error"]["code"] == "receipt.not_found"
        assert (await http.get(f"/aip/v1/receipts/{ref['id']}")).status_code == 401


async def test_the_receipt_keys_are_published_without_authentication(app, make_app):
    async with running(app) as http:
        keys = (await http.get("/.well-known/aip-receipt-keys")).json()["keys"]
    assert [(k["key_id"], k["current"]) for k in keys] == [
        (rc.key_id(KEY.public_key()), True),
        (rc.key_id(OLD.public_key()), False),
    ]
    async with running(make_app()) as http:
        assert (await http.get("/.well-known/aip-receipt-keys")).json() == {"keys": []}


async def test_a_host_without_a_receipt_key_signs_nothing_but_still_reports_usage(make_app):
    app = make_app()
    async with running(app) as http:
        result = await finish_run(app)
        assert "receipt" not in result and result["usage"]["tokens"]["total"] == 15
        status = await http.get("/aip/v1/actions/act_1?include_receipts=true", headers=bearer("acme-invoker"))
        assert status.json()["receipt_chain"] == {"chain_id": "act_1", "receipts": []}


async def test_the_action_view_carries_usage_and_its_receipt_chain_when_asked(app):
    async with running(app) as http:
        await finish_run(app)
        plain = (await http.get("/aip/v1/actions/act_1", headers=bearer("acme-invoker"))).json()
        assert "receipt_chain" not in plain and plain["result"]["usage"]["tokens"]["prompt"] == 10
        view = (await http.get("/aip/v1/actions/act_1?include_receipts=true", headers=bearer("acme-invoker"))).json()
    (entry,) = view["receipt_chain"]["receipts"]
    assert entry["receipt_type"] == "result_returned" and entry["id"] == view["result"]["receipt"]["id"]
    assert view["receipt_chain"]["root_hash"] == entry["hash"] == entry["data"]["hash"]
    assert rc.verify(rc.jcs(entry["data"]), [KEY.public_key()])["status"] == "completed"


async def test_usage_is_for_operators_and_sums_the_tenants_crews(app):
    async with running(app) as http:
        await finish_run(app, "act_1")
        await finish_run(app, "act_2", crew="alpha")
        await finish_run(app, "act_g", tenant="globex", crew="gamma")
        refused = await http.get("/aip/v1/usage", headers=bearer("acme-invoker"))
        assert refused.status_code == 403
        report = (await http.get("/aip/v1/usage", headers=bearer("acme-operator"))).json()
    assert report["tenant"] == "acme" and [c["crew_id"] for c in report["crews"]] == ["alpha", "beta"]
    assert report["totals"]["actions"] == 2 and report["totals"]["tokens"]["total"] == 30
    assert report["totals"]["cost"] == []  # no [pricing]


@pytest.mark.parametrize(
    ("query", "status"),
    [
        ("?from=yesterday", 400),
        ("?to=2026-13-01T00:00:00Z", 400),
        (f"?from={ms_to_rfc3339(int(NOW * 1000))}&to={ms_to_rfc3339(int(NOW * 1000))}", 400),  # from == to
        (f"?from={ms_to_rfc3339(int(NOW * 1000) - 1)}&to={ms_to_rfc3339(int(NOW * 1000))}", 200),  # 1 ms
        ("?to=9999-12-31T23:59:59.999Z", 200),  # the last instant RFC 3339 holds
        ("?to=9999-12-31T23:59:59-00:01", 400),  # year 10000 in UTC: was a 500
        ("?from=0001-01-01T00:00:00Z", 200),
        ("?from=0001-01-01T00:00:00%2B00:01", 400),  # year 0 in UTC: was a 500
    ],
)
async def test_the_usage_period_is_checked_at_its_edges(app, query, status):
    async with running(app) as http:
        answer = await http.get(f"/aip/v1/usage{query}", headers=bearer("acme-operator"))
    assert answer.status_code == status, answer.text
    if status == 400:
        assert answer.json()["body"]["error"]["error"]["code"] == "request.invalid_range"
    elif query.startswith("?from=0001"):
        assert answer.json()["from"] == "0001-01-01T00:00:00.000Z"  # four digits: it echoed 1-01-01T…


def test_the_receipt_key_and_pricing_settings_are_checked_keyed(host_files):
    from kits.hostapp import base_document, render_toml

    from aip_crewai.host.config import HostConfigError, load_settings
    from aip_crewai.plumbing.keys import generate_ed25519

    key = host_files.root / "receipt.key"
    generate_ed25519(key)
    doc = base_document()
    doc["host"]["receipt_key_file"] = "receipt.key"
    pricing = '\n[pricing.models.m]\nprompt = "0.15"\ncompletion = "0.6"\n[pricing.crews]\n'
    host_files.config.write_text(render_toml(doc) + pricing + 'beta = "m"\n')
    loaded = load_settings(host_files.config, environ={})
    assert loaded.receipt_keys is not None and loaded.pricing is not None
    key.chmod(0o640)
    with pytest.raises(HostConfigError) as caught:
        load_settings(host_files.config, environ={})
    assert caught.value.key == "host.receipt_key_file"
    key.chmod(0o600)
    host_files.config.write_text(render_toml(doc) + pricing + 'nope = "m"\n')
    with pytest.raises(HostConfigError) as caught:
        load_settings(host_files.config, environ={})
    assert caught.value.key == "pricing.crews.nope"
