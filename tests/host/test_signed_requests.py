"""Signed requests (RFC 9421): a principal holding only an Ed25519
key lists, shows and decides approvals and reads what its role allows; replays,
tampering and mismatched credentials are 401; a signed decision keeps its proof."""

from __future__ import annotations

import base64
import json

import httpx2
import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import NOW, SIDECAR_TOKEN, bearer, private_key, running, submit_action

from aip_crewai.client import RequestSigner
from aip_crewai.host.http.state import host_state

CT = {"Content-Type": "application/aip+json"}


def signer(principal: str) -> RequestSigner:
    return RequestSigner(private_key(principal), principal, clock=lambda: NOW)


@pytest.fixture
async def world(make_app):
    """The app over a fake sidecar, with one action of acme-invoker pending approval."""
    app = make_app(sidecar_transport=FakeSidecar(SIDECAR_TOKEN).transport())
    async with running(app) as http:
        output = await submit_action(http, "sig_run")
        yield app, http, output["approval_id"], output["policy_hash"]


async def test_a_key_only_approver_lists_shows_decides_and_reads_the_action(world):
    app, http, approval_id, policy_hash = world
    auth = signer("acme-approver")
    listed = await http.get("/aip/v1/approvals", auth=auth)
    assert listed.status_code == 200
    assert [a["request"]["id"] for a in listed.json()["approvals"]] == [approval_id]
    shown = await http.get(f"/aip/v1/approvals/{approval_id}", auth=auth)
    assert shown.status_code == 200 and shown.json()["evidence_payload"]["input"] == {"topic": "t"}
    decided = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        auth=auth,
        json={"decision": "approved", "reason": "fine", "policy_hash": policy_hash},
    )
    assert decided.status_code == 200, decided.text
    evidence = decided.json()["evidence"]
    assert [(e["kind"], e["uri"]) for e in evidence] == [
        ("http_message_signature", f"/aip/v1/approvals/{approval_id}/proof")
    ]
    service = host_state(app).actions
    await service.wait(await service.store.get_action("acme", "sig_run"), 10)
    action = await http.get("/aip/v1/actions/sig_run", auth=auth)  # it decided the approval: full read
    assert action.status_code == 200 and action.json()["result_status"] == "completed"
    record = await http.get(f"/aip/v1/approvals/{approval_id}", auth=auth)
    assert record.json()["decision"]["evidence"] == evidence


async def test_the_stored_proof_shows_who_approved_which_policy_hash(world):
    _, http, approval_id, policy_hash = world
    auth = signer("acme-approver")
    await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        auth=auth,
        json={"decision": "approved", "reason": "fine", "policy_hash": policy_hash},
    )
    proof = (await http.get(f"/aip/v1/approvals/{approval_id}/proof", auth=auth)).json()
    assert proof["key_id"] == "acme-approver" and proof["alg"] == "ed25519"
    # Offline: the signature verifies over the base; the base's digest is the body's; the body names the hash.
    private_key("acme-approver").public_key().verify(
        base64.b64decode(proof["signature"]), proof["signature_base"].encode()
    )
    assert f'"@path": /aip/v1/approvals/{approval_id}/decision' in proof["signature_base"]
    from http_message_signatures import ContentDigest

    digest_line = next(line for line in proof["signature_base"].splitlines() if line.startswith('"content-digest"'))
    ContentDigest.verify(digest_line.split(": ", 1)[1], proof["body"].encode())
    assert json.loads(proof["body"])["policy_hash"] == policy_hash
    evidence_hash = (await http.get(f"/aip/v1/approvals/{approval_id}", auth=auth)).json()["decision"]["evidence"][0]
    import hashlib

    assert evidence_hash["hash"] == "sha256:" + hashlib.sha256(proof["signature_base"].encode()).hexdigest()


async def test_an_unsigned_decision_has_no_proof(world):
    _, http, approval_id, _ = world
    decided = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer("acme-both"),
        json={"decision": "denied", "reason": "no"},
    )
    assert decided.status_code == 200 and "evidence" not in decided.json()
    missing = await http.get(f"/aip/v1/approvals/{approval_id}/proof", headers=bearer("acme-both"))
    assert missing.status_code == 404
    assert missing.json()["body"]["error"]["error"]["code"] == "approval.no_proof"


async def test_a_signed_decision_must_name_the_policy_hash(world):
    _, http, approval_id, _ = world
    response = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        auth=signer("acme-approver"),
        json={"decision": "approved", "reason": "fine"},
    )
    assert response.status_code == 400 and "policy_hash" in response.text


async def test_a_signed_decision_for_another_policy_hash_is_409(world):
    _, http, approval_id, _ = world
    response = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        auth=signer("acme-approver"),
        json={"decision": "approved", "reason": "fine", "policy_hash": "0" * 64},
    )
    assert response.status_code == 409


async def test_a_signed_decision_that_names_its_decision_twice_is_refused_and_keeps_no_proof(world):
    """The signed body is the decision's evidence: one that a first-name parser reads "denied" and a
    last-name parser "approved" is refused (400), and nothing is decided or kept."""
    _, http, approval_id, policy_hash = world
    body = f'{{"decision":"denied","decision":"approved","reason":"checked","policy_hash":"{policy_hash}"}}'
    response = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        auth=signer("acme-approver"),
        content=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["body"]["error"]["error"]["code"] == "message.invalid_envelope"
    proof = await http.get(f"/aip/v1/approvals/{approval_id}/proof", auth=signer("acme-approver"))
    assert proof.status_code == 404
    shown = await http.get(f"/aip/v1/approvals/{approval_id}", auth=signer("acme-approver"))
    assert shown.json()["status"] == "pending"


async def test_without_a_signature_the_key_only_approver_is_401(world):
    _, http, _, _ = world
    response = await http.get("/aip/v1/approvals")
    assert response.status_code == 401


async def test_a_replayed_signed_request_is_401(world):
    _, http, _, _ = world
    first = await http.get("/aip/v1/approvals", auth=signer("acme-approver"))
    headers = {k: v for k, v in first.request.headers.items() if k.lower() in ("signature", "signature-input")}
    replay = await http.get("/aip/v1/approvals", headers=headers)
    assert first.status_code == 200 and replay.status_code == 401
    assert "nonce was already used" in replay.json()["body"]["error"]["error"]["message"]


async def test_a_signature_for_another_route_or_body_is_401(world):
    _, http, approval_id, policy_hash = world
    first = await http.get("/aip/v1/approvals", auth=signer("acme-approver"))
    headers = {k: v for k, v in first.request.headers.items() if k.lower() in ("signature", "signature-input")}
    assert (await http.get(f"/aip/v1/approvals/{approval_id}", headers=headers)).status_code == 401
    request = http.build_request(
        "POST",
        f"/aip/v1/approvals/{approval_id}/decision",
        json={"decision": "approved", "reason": "fine", "policy_hash": policy_hash},
    )
    signed = signer("acme-approver").auth_flow(request)
    tampered = next(signed)
    body = json.dumps({"decision": "denied", "reason": "fine", "policy_hash": policy_hash}).encode()
    response = await http.post(
        tampered.url, content=body, headers={k: v for k, v in tampered.headers.items() if k.lower() != "content-length"}
    )
    assert response.status_code == 401 and "content digest" in response.text


async def test_bearer_and_signature_of_different_principals_are_401(world):
    _, http, _, _ = world
    response = await http.get("/aip/v1/approvals", headers=bearer("acme-both"), auth=signer("acme-approver"))
    assert response.status_code == 401
    same = await http.get("/aip/v1/approvals", headers=bearer("acme-both"), auth=signer("acme-both"))
    assert same.status_code == 200


async def test_roles_still_apply_to_signed_requests(world):
    _, http, _, _ = world
    # globex-signer is an invoker (key only): approvals are not its to read.
    response = await http.get("/aip/v1/approvals", auth=signer("globex-signer"))
    assert response.status_code == 403


async def test_a_signed_request_submits_an_action_without_a_signed_envelope(world):
    _, http, _, _ = world
    env = {
        "aip_version": "1.0",
        "message_type": "aip.core.v1.action",
        "message_id": "msg_sig2",
        "sent_at": "2026-09-21T14:13:20.000Z",
        "body": {
            "action": {
                "id": "sig_run2",
                "capability_id": "cap:crewai:gamma",
                "input": {"topic": "t"},
                "idempotency_key": "k-sig2",
            }
        },
    }
    response = await http.post("/aip/v1/messages", content=json.dumps(env), headers=CT, auth=signer("globex-signer"))
    assert response.status_code == 202, response.text
    assert response.json()["body"]["action_result"]["status"] == "pending_approval"


async def test_a_stale_signature_is_401(world, clock):
    _, http, _, _ = world
    stale = RequestSigner(private_key("acme-approver"), "acme-approver", clock=lambda: NOW - 301)
    assert (await http.get("/aip/v1/approvals", auth=stale)).status_code == 401
    edge = RequestSigner(private_key("acme-approver"), "acme-approver", clock=lambda: NOW - 300)
    assert (await http.get("/aip/v1/approvals", auth=edge)).status_code == 200


def test_the_client_refuses_a_signing_key_without_a_key_id():
    from aip_crewai.client import AipClient

    with pytest.raises(ValueError):
        AipClient("http://127.0.0.1:1", signing_key=private_key("acme-approver"))
    assert isinstance(signer("acme-approver"), httpx2.Auth)


def target_uri_signed(request: httpx2.Request, principal: str) -> httpx2.Request:
    """Sign as the approval console does: ``@method`` + ``@target-uri`` (+ ``content-digest``),
    label ``sig1``, a nonce in standard base64 (console.js ``signedHeaders``)."""
    import datetime
    import secrets

    from http_message_signatures import HTTPMessageSigner, algorithms

    from aip_crewai.plumbing.httpsig import _Keys, _Message

    headers: dict[str, str] = {}
    signer = HTTPMessageSigner(
        signature_algorithm=algorithms.ED25519, key_resolver=_Keys(private=private_key(principal))
    )
    signer.sign(
        _Message(request.method, str(request.url), headers),
        key_id=principal,
        label="sig1",
        nonce=base64.b64encode(secrets.token_bytes(16)).decode(),
        created=datetime.datetime.fromtimestamp(NOW, tz=datetime.timezone.utc),
        covered_component_ids=("@method", "@target-uri"),
        body=request.content or None,
    )
    request.headers.update(headers)
    return request


async def test_the_consoles_target_uri_signatures_are_accepted(world):
    _, http, approval_id, policy_hash = world
    listed = await http.send(target_uri_signed(http.build_request("GET", "/aip/v1/approvals"), "acme-approver"))
    assert listed.status_code == 200, listed.text
    request = http.build_request(
        "POST",
        f"/aip/v1/approvals/{approval_id}/decision",
        json={"decision": "approved", "reason": "console", "policy_hash": policy_hash},
    )
    decided = await http.send(target_uri_signed(request, "acme-approver"))
    assert decided.status_code == 200, decided.text
    proof = (await http.get(f"/aip/v1/approvals/{approval_id}/proof", auth=signer("acme-approver"))).json()
    assert f'"@target-uri": http://host.test/aip/v1/approvals/{approval_id}/decision' in proof["signature_base"]


@pytest.mark.parametrize(
    "authority, server, bind, listed, allowed",
    [
        ("127.0.0.1:8081", ("127.0.0.1", 8081), "127.0.0.1", None, True),
        ("LOCALHOST:8081", ("127.0.0.1", 8081), "127.0.0.1", None, True),
        ("[::1]:8081", ("127.0.0.1", 8081), "127.0.0.1", None, True),
        ("127.0.0.1:8082", ("127.0.0.1", 8081), "127.0.0.1", None, False),
        ("aip.other-deployment.example", ("127.0.0.1", 8081), "127.0.0.1", None, False),
        ("10.0.0.11:8081", ("10.0.0.11", 8081), "0.0.0.0", None, True),
        ("localhost:8081", ("10.0.0.11", 8081), "0.0.0.0", None, False),
        ("aip.example.com", ("10.0.0.11", 8081), "0.0.0.0", None, False),
        ("host.test", ("host.test", 80), "127.0.0.1", None, True),
        ("aip.example.com", ("10.0.0.11", 8081), "0.0.0.0", ("aip.example.com",), True),
        ("AIP.example.com", ("10.0.0.11", 8081), "0.0.0.0", ("aip.example.com",), True),
        ("aip.example.com:443", ("10.0.0.11", 8081), "0.0.0.0", ("aip.example.com",), False),
        ("10.0.0.11:8081", ("10.0.0.11", 8081), "0.0.0.0", ("aip.example.com",), False),
        ("127.0.0.1:8081", None, "127.0.0.1", None, False),
    ],
)
def test_the_authority_rule_lists_or_defaults_to_the_bind_address_forms(authority, server, bind, listed, allowed):
    """docs/approvals.md "Signed requests": ``[host] public_authorities`` exactly (any case); by default the address the
    connection arrived at and the bind address with that port, plus the loopback names for a loopback host."""
    from aip_crewai.host.auth.signatures import PublicAuthorities

    assert PublicAuthorities(listed, bind).allows(authority, server) is allowed


async def test_a_signature_naming_an_unlisted_authority_is_401_naming_the_rule(make_app, settings):
    import dataclasses

    app = make_app(dataclasses.replace(settings, public_authorities=("aip.example.com",)))
    async with running(app) as http:
        refused = await http.get("/aip/v1/approvals", auth=signer("acme-approver"))
        assert refused.status_code == 401
        message = refused.json()["body"]["error"]["error"]["message"]
        assert message.startswith("signed request: @authority 'host.test' is not an authority of this host")
        assert (await http.get("/aip/v1/approvals", headers=bearer("acme-both"))).status_code == 200


def test_public_authorities_are_checked_in_host_toml(host_files):
    from kits.hostapp import base_document

    from aip_crewai.host.config import HostConfigError, load_settings

    doc = base_document()
    assert load_settings(host_files.write(doc)).public_authorities is None
    doc["host"]["public_authorities"] = ["AIP.example.com", "10.0.0.11:8081", "[::1]:8081"]
    assert load_settings(host_files.write(doc)).public_authorities == (
        "aip.example.com",
        "10.0.0.11:8081",
        "[::1]:8081",
    )
    for bad in (["https://aip.example.com"], ["aip.example.com/path"], [], ["*.example.com"]):
        doc["host"]["public_authorities"] = bad
        with pytest.raises(HostConfigError, match="public_authorities"):
            load_settings(host_files.write(doc))
