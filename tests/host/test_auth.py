"""Principal authentication: bearer hashes, Ed25519 envelopes, replay, roles (ARCHITECTURE.md §7)."""

from __future__ import annotations

import copy

import msgspec
import pytest
from kits.hostapp import NOW, TOKENS, bearer, envelope, running, sign

from aip_crewai.contracts.aip import Envelope
from aip_crewai.contracts.errors import Forbidden, Unauthenticated
from aip_crewai.host.auth.principals import Authenticator, Principal, require_role
from aip_crewai.host.auth.signatures import signed_bytes
from aip_crewai.host.http.state import host_setup
from aip_crewai.host.store.store import Store


@pytest.fixture
async def store(settings):
    opened = await Store.open(settings.store_path)
    yield opened
    await opened.close()


@pytest.fixture
def auth(settings, store, clock) -> Authenticator:
    return Authenticator(settings.principals, store, clock=clock)


async def rejected(auth: Authenticator, header: str | None, obj: dict | None) -> str:
    with pytest.raises(Unauthenticated) as info:
        await auth.authenticate(header, obj)
    assert info.value.status == 401 and info.value.code == "auth.unauthenticated"
    return info.value.message


async def test_bearer_token_maps_to_its_principal(auth):
    principal = await auth.authenticate(f"Bearer {TOKENS['acme-invoker']}", None)
    assert principal == Principal("acme-invoker", "acme", frozenset({"invoker"}), "bearer")
    assert (await auth.authenticate(f"bearer  {TOKENS['globex-invoker']}", None)).tenant == "globex"


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer wrong-token",
        "Basic dXNlcjpwYXNz",
        f"Token {TOKENS['acme-invoker']}",
        "Bearer " + "x" * 5000,
    ],
)
async def test_missing_or_wrong_bearer_is_401(auth, header):
    await rejected(auth, header, None)


async def test_every_hash_is_compared(auth, monkeypatch):
    """No early exit: all configured hashes are compared whatever matches."""
    import aip_crewai.host.auth.principals as module

    calls = []
    real = module.hmac.compare_digest
    monkeypatch.setattr(module.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    await auth.authenticate(f"Bearer {TOKENS['acme-invoker']}", None)  # the first principal
    assert len(calls) == len(TOKENS)


async def test_signed_envelope_authenticates_its_key_id(auth):
    principal = await auth.authenticate(None, sign(envelope(), "acme-approver"))
    assert (principal.id, principal.tenant, principal.method) == ("acme-approver", "acme", "ed25519")


async def test_signature_covers_the_received_object_not_a_reencoded_struct(auth):
    """Fields a Struct would omit (defaults, nulls) are part of the signed bytes."""
    obj = envelope(correlation_id=None)
    obj["body"]["action"]["idempotency_key"] = None
    signed = sign(obj, "acme-approver")
    reencoded = msgspec.to_builtins(msgspec.convert(signed, Envelope))
    assert reencoded != signed  # the Struct drops the nulls
    assert await auth.authenticate(None, signed)
    assert signed_bytes(signed) != signed_bytes({**reencoded, "security": signed["security"]})


@pytest.mark.parametrize("tamper", ["input", "added-field", "signature-bits", "padding", "short", "key_id"])
async def test_tampered_signatures_are_401(auth, tamper):
    signed = sign(envelope(), "acme-approver")
    bad = copy.deepcopy(signed)
    if tamper == "input":
        bad["body"]["action"]["input"]["topic"] = "y"
    elif tamper == "added-field":
        bad["correlation_id"] = "added later"
    elif tamper == "signature-bits":
        sig = bad["security"]["signature"]
        bad["security"]["signature"] = ("A" if sig[0] != "A" else "B") + sig[1:]
    elif tamper == "padding":
        bad["security"]["signature"] += "=="
    elif tamper == "short":
        bad["security"]["signature"] = bad["security"]["signature"][:40]
    elif tamper == "key_id":
        bad["security"]["key_id"] = "globex-signer"
    await rejected(auth, None, bad)


@pytest.mark.parametrize("offset_s", [-301, 301])
async def test_stale_or_future_sent_at_is_401(auth, offset_s):
    message = await rejected(auth, None, sign(envelope(sent_at_s=NOW + offset_s), "acme-approver"))
    assert "sent_at" in message


@pytest.mark.parametrize("offset_s", [-300, 300])
async def test_sent_at_at_the_window_edges_is_accepted(auth, offset_s):
    assert await auth.authenticate(None, sign(envelope(sent_at_s=NOW + offset_s), "acme-approver"))


async def test_unparseable_sent_at_is_401(auth):
    await rejected(auth, None, sign({**envelope(), "sent_at": "yesterday"}, "acme-approver"))


async def claimed(auth: Authenticator, header: str | None, obj: dict) -> Principal:
    """Authenticate, then claim the message id as the action service does once the request is authorized."""
    principal = await auth.authenticate(header, obj)
    await auth.claim(principal)
    return principal


async def replayed(auth: Authenticator, header: str | None, obj: dict) -> str:
    principal = await auth.authenticate(header, obj)  # the signature itself is fine
    with pytest.raises(Unauthenticated) as info:
        await auth.claim(principal)
    return info.value.message


async def test_replayed_message_id_is_401(auth):
    first = sign(envelope("msg_once"), "acme-approver")
    assert await claimed(auth, None, first)
    assert "already used" in await replayed(auth, None, first)
    # Re-signing with the same id and key does not help either.
    assert "already used" in await replayed(auth, None, sign(envelope("msg_once", sent_at_s=NOW + 1), "acme-approver"))


async def test_message_ids_are_claimed_per_key_and_only_when_claimed(auth):
    """Issue 16 item 8: ids are claimed per signing key, and authenticating alone claims nothing."""
    obj = sign(envelope("msg_shared"), "acme-approver")
    assert await auth.authenticate(None, obj) and await auth.authenticate(None, obj)  # not claimed yet
    assert await claimed(auth, None, obj)
    assert (await claimed(auth, None, sign(envelope("msg_shared"), "acme-both"))).id == "acme-both"  # another key
    assert (await claimed(auth, None, sign(envelope("msg_shared"), "globex-signer"))).tenant == "globex"


async def test_a_tenant_wide_claim_from_before_the_upgrade_still_blocks_its_id(auth, store):
    await store.claim_message_id("acme", "msg_legacy", 10**15)
    assert "already used" in await replayed(auth, None, sign(envelope("msg_legacy"), "acme-approver"))


async def test_forged_messages_do_not_burn_message_ids(auth):
    forged = sign(envelope("msg_target"), "acme-approver")
    forged["body"]["action"]["input"]["topic"] = "evil"
    await rejected(auth, None, forged)
    assert await claimed(auth, None, sign(envelope("msg_target"), "acme-approver"))


async def test_unknown_key_id_and_keyless_principal_are_401(auth):
    await rejected(auth, None, sign(envelope(), "acme-approver", key_id="nobody"))
    await rejected(auth, None, sign(envelope(), "acme-approver", key_id="acme-invoker"))  # bearer-only principal


async def test_other_schemes_are_401(auth):
    obj = sign(envelope(), "acme-approver")
    obj["security"]["scheme"] = "hmac"
    await rejected(auth, None, obj)


async def test_bearer_plus_signature_must_agree(auth):
    both = f"Bearer {TOKENS['acme-both']}"
    assert (await auth.authenticate(both, sign(envelope("msg_a"), "acme-both"))).id == "acme-both"
    await rejected(auth, both, sign(envelope("msg_b"), "acme-approver"))


def test_roles():
    principal = Principal("p", "acme", frozenset({"invoker"}))
    require_role(principal, "invoker")
    with pytest.raises(Forbidden) as info:
        require_role(principal, "approver")
    assert info.value.status == 403 and info.value.code == "policy.forbidden"


# --- over HTTP ----------------------------------------------------------------


async def test_http_401_has_an_aip_error_body_and_www_authenticate(client):
    response = await client.get("/aip/v1/manifest", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["content-type"] == "application/aip+json"
    body = response.json()
    assert body["message_type"] == "aip.core.v1.error"
    assert body["body"]["error"]["error"]["code"] == "auth.unauthenticated"
    assert body["body"]["error"]["error"]["category"] == "auth"
    assert "nope" not in response.text


async def test_http_missing_credentials_is_401(client):
    assert (await client.get("/aip/v1/capabilities")).status_code == 401


@pytest.mark.parametrize("second", ["Bearer nope", f"Bearer {TOKENS['acme-invoker']}"])
async def test_http_two_authorization_headers_are_401_whichever_comes_first(client, second):
    # Only the first used to count: a valid token first let a request through beside any second credential.
    good = f"Bearer {TOKENS['acme-invoker']}"
    for pair in ([good, second], [second, good]):
        response = await client.get("/aip/v1/capabilities", headers=[("Authorization", v) for v in pair])
        assert response.status_code == 401, response.text
        assert response.json()["body"]["error"]["error"]["message"] == "send one Authorization header, not several"


async def test_auth_failures_are_counted(make_app):
    app = make_app()
    async with running(app) as http:
        await http.get("/aip/v1/manifest")
        await http.get("/aip/v1/manifest", headers=bearer("acme-invoker"))
    assert host_setup(app).metrics.auth_failures.value() == 1


@pytest.mark.parametrize(
    ("number", "field"),
    [
        (1.0, "$.body.action.input.n"),
        (-0.0, "$.body.action.input.n"),
        (2**53, "$.body.action.input.n"),
        (-(2**60), "$.body.action.input.n"),
    ],
)
async def test_signed_envelopes_with_non_canonical_or_unsignable_numbers_are_a_typed_400(auth, number, field):
    """Issue 16 item 6: 1 signed could run as 1.0 (1.0, 1e0, -0.0 all sign alike); 2**53 and beyond were a 401.
    Both are input errors now: 400 message.non_canonical_number naming the field; nothing is claimed."""
    from aip_crewai.contracts.errors import NonCanonicalNumber

    obj = envelope("msg_num")
    obj["body"]["action"]["input"] = {"topic": "x", "n": number}
    with pytest.raises(NonCanonicalNumber) as info:
        await auth.authenticate(
            None,
            sign(obj, "acme-approver")
            if abs(number) < 2**53
            else {**obj, "security": sign(envelope(), "acme-approver")["security"]},
        )
    assert info.value.status == 400 and info.value.code == "message.non_canonical_number"
    assert info.value.field == field
    assert await claimed(auth, None, sign(envelope("msg_num"), "acme-approver"))  # the id is still free


async def test_canonical_numbers_in_signed_envelopes_pass(auth):
    obj = envelope("msg_ok")
    obj["body"]["action"]["input"] = {"topic": "x", "n": [1, 1.5, 1e300, 0.1, -7, 2**53 - 1]}
    assert await auth.authenticate(None, sign(obj, "acme-approver"))


async def test_a_signed_envelope_nested_past_the_input_bound_is_a_400(auth):
    from aip_crewai.contracts.errors import InvalidInput
    from aip_crewai.contracts.inputs import MAX_INPUT_DEPTH

    nested: dict = {"topic": "x"}
    for _ in range(MAX_INPUT_DEPTH + 5):
        nested = {"n": nested}
    obj = envelope("msg_deep")
    obj["body"]["action"]["input"] = nested
    with pytest.raises(InvalidInput) as info:
        await auth.authenticate(None, {**obj, "security": sign(envelope(), "acme-approver")["security"]})
    assert info.value.status == 400
    assert info.value.field == "$.body.action.input" + ".n" * MAX_INPUT_DEPTH  # the input's 65th level


@pytest.mark.parametrize("extra", [0, 1])
async def test_a_signed_envelope_names_the_first_container_past_its_bound_wherever_it_is(auth, extra):
    """The refusal named ``$.body.action.input`` whatever nested too deep (here ``extensions``, before the input
    in the text): it names the first container past the envelope's bound, with the envelope's rule, and none
    at the bound itself."""
    from aip_crewai.contracts.errors import InvalidInput
    from aip_crewai.host.auth.principals import MAX_ENVELOPE_DEPTH

    deep: list = []
    for _ in range(MAX_ENVELOPE_DEPTH - 2 + extra):  # the envelope is level 1, extensions level 2, ...
        deep = [deep]
    obj = {"extensions": deep, **envelope("msg_ext")}
    signed = {**obj, "security": sign(envelope(), "acme-approver")["security"]}
    if not extra:  # at the bound: past the depth check (the signature, over another envelope, is refused)
        await rejected(auth, None, signed)
        return
    with pytest.raises(InvalidInput) as info:
        await auth.authenticate(None, signed)
    assert info.value.field == "$.extensions" + "[0]" * (MAX_ENVELOPE_DEPTH - 1)
    assert info.value.rule == f"the envelope nests deeper than {MAX_ENVELOPE_DEPTH} levels of objects and arrays"
