"""The RFC 9421 profile of aip_crewai.plumbing.httpsig: what verifies, and each rule a request can break."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.plumbing import httpsig
from aip_crewai.plumbing.httpsig import MAX_CLOCK_SKEW_S, SignatureRejected, sign_request, verify_request

KEY = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
OTHER = Ed25519PrivateKey.from_private_bytes(b"\x08" * 32)
KEYS = {"human:approver": KEY.public_key()}
NOW = 1_790_000_000
URL = "http://127.0.0.1:8081/aip/v1/approvals/apr_1/decision?x=1"
BODY = b'{"decision":"approved","reason":"ok","policy_hash":"abc"}'


def signed(
    method: str = "POST",
    url: str = URL,
    body: bytes = BODY,
    *,
    key=KEY,
    key_id="human:approver",
    created: int = NOW,
    nonce: str | None = None,
) -> dict[str, str]:
    return sign_request(method, url, body, key, key_id, created=created, nonce=nonce)


def verify(headers: dict[str, str], method: str = "POST", url: str = URL, body: bytes = BODY, *, now: float = NOW):
    return verify_request(method, url, list(headers.items()), body, public_key=KEYS.get, now_s=now)


def reason(headers: dict[str, str], **kwargs) -> str:
    with pytest.raises(SignatureRejected) as caught:
        verify(headers, **kwargs)
    return caught.value.reason


def test_a_signed_request_verifies_and_keeps_its_proof():
    headers = signed(nonce="n" * 22)
    verified = verify(headers)
    assert (verified.key_id, verified.created, verified.nonce) == ("human:approver", NOW, "n" * 22)
    assert verified.signature_base.splitlines()[:4] == [
        '"@method": POST',
        '"@authority": 127.0.0.1:8081',
        '"@path": /aip/v1/approvals/apr_1/decision',
        '"@query": ?x=1',
    ]
    assert verified.signature_base.splitlines()[4].startswith('"content-digest": sha-256=:')
    # The proof re-verifies offline with the public key alone.
    proof = verified.proof()
    KEY.public_key().verify(base64.b64decode(proof["signature"]), proof["signature_base"].encode())
    assert 'alg="ed25519"' in proof["signature_input"] and 'keyid="human:approver"' in proof["signature_input"]


def test_a_request_without_a_body_needs_no_digest():
    headers = signed("GET", "http://h.test/aip/v1/approvals", b"")
    assert "Content-Digest" not in headers
    assert verify(headers, "GET", "http://h.test/aip/v1/approvals", b"").key_id == "human:approver"


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"method": "PUT"}, "does not verify"),
        ({"url": URL.replace("apr_1", "apr_2")}, "does not verify"),
        ({"url": URL.replace("?x=1", "?x=2")}, "does not verify"),
        ({"url": URL.replace("8081", "8082")}, "does not verify"),
        ({"body": BODY.replace(b"approved", b"denied!!")}, "content digest"),
        ({"body": b""}, "content digest"),
    ],
)
def test_any_change_to_a_covered_part_is_rejected(change, expected):
    assert expected in reason(signed(), **change)


def test_a_body_without_a_signed_digest_is_rejected():
    headers = signed("POST", URL, b"")  # signed as bodyless
    assert "Content-Digest" in reason(headers, body=BODY)


def test_another_key_or_an_unknown_key_id_is_rejected():
    assert "does not verify" in reason(signed(key=OTHER))
    assert "unknown signing key" in reason(signed(key_id="human:nobody"))


@pytest.mark.parametrize("offset", [-MAX_CLOCK_SKEW_S, MAX_CLOCK_SKEW_S])
def test_created_at_the_window_edges_is_accepted(offset):
    assert verify(signed(created=NOW + offset)).created == NOW + offset


@pytest.mark.parametrize("offset", [-MAX_CLOCK_SKEW_S - 1, MAX_CLOCK_SKEW_S + 1])
def test_created_one_second_past_the_window_is_rejected(offset):
    assert "300 s" in reason(signed(created=NOW + offset))


@pytest.mark.parametrize("length", [httpsig.MIN_NONCE_CHARS, httpsig.MAX_NONCE_CHARS])
def test_nonces_at_their_length_bounds_are_accepted(length):
    assert verify(signed(nonce="a" * length)).nonce == "a" * length


@pytest.mark.parametrize(
    "nonce",
    [
        "a" * (httpsig.MIN_NONCE_CHARS - 1),
        "a" * (httpsig.MAX_NONCE_CHARS + 1),
        "a" * 20 + "*",
        "a" * 20 + " ",
        "a" * 20 + ".",
    ],
)
def test_nonces_outside_the_profile_are_rejected(nonce):
    assert "nonce" in reason(signed(nonce=nonce))


def _resign(headers: dict[str, str], params: str, *, components: str | None = None) -> dict[str, str]:
    """Sign again with a hand-written signature-params (to test parameters the signer never writes)."""
    covered = components or '("@method" "@authority" "@path" "@query" "content-digest")'
    digest = headers["Content-Digest"]
    values = {
        "@method": "POST",
        "@authority": "127.0.0.1:8081",
        "@path": "/aip/v1/approvals/apr_1/decision",
        "@query": "?x=1",
        "content-digest": digest,
    }
    names = re.findall(r'"([^"]+)"', covered)
    base = "\n".join([*(f'"{name}": {values[name]}' for name in names), f'"@signature-params": {covered}{params}'])
    signature = base64.b64encode(KEY.sign(base.encode())).decode()
    return {"Content-Digest": digest, "Signature-Input": f"aip={covered}{params}", "Signature": f"aip=:{signature}:"}


OK_PARAMS = f';created={NOW};keyid="human:approver";alg="ed25519";nonce="{"n" * 22}"'


def console_signed(
    method: str,
    url: str,
    body: bytes | None,
    *,
    nonce: str = "q83vEjRWeJq8",
    created: int = NOW,
    components: tuple[str, ...] = ("@method", "@target-uri"),
) -> dict[str, str]:
    """What the approval console's JavaScript sends (aip_crewai/host/console_static/console.js,
    ``signedHeaders``): label ``sig1``, ``@method`` + ``@target-uri`` (+ ``content-digest``), a
    nonce in standard base64 of 16 random bytes."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    values = {"@method": method, "@target-uri": url, "@path": parts.path, "@query": f"?{parts.query}"}
    headers = {}
    names = list(components)
    if body is not None:
        import hashlib

        headers["Content-Digest"] = f"sha-256=:{base64.b64encode(hashlib.sha256(body).digest()).decode()}:"
        values["content-digest"] = headers["Content-Digest"]
        names.append("content-digest")
    nonce = base64.b64encode(nonce.encode()[:16].ljust(16, b"\xfb")).decode()  # has "+" or "/" and "=="
    params = (
        f'({" ".join(chr(34) + n + chr(34) for n in names)});created={created};keyid="human:approver";'
        f'alg="ed25519";nonce="{nonce}"'
    )
    base = "\n".join([*(f'"{n}": {values[n]}' for n in names), f'"@signature-params": {params}'])
    headers["Signature-Input"] = f"sig1={params}"
    headers["Signature"] = f"sig1=:{base64.b64encode(KEY.sign(base.encode())).decode()}:"
    return headers


def test_the_consoles_target_uri_signatures_verify():
    headers = console_signed("POST", URL, BODY)
    assert "==" in headers["Signature-Input"]
    verified = verify(headers)
    assert verified.signature_base.splitlines()[1] == f'"@target-uri": {URL}'
    get = console_signed("GET", "http://127.0.0.1:8081/aip/v1/approvals/events", None, nonce="another-nonce-16b")
    assert verify(get, "GET", "http://127.0.0.1:8081/aip/v1/approvals/events", b"").nonce
    assert "does not verify" in reason(headers, url=URL.replace("http://", "https://"))
    assert "must cover" in reason(console_signed("POST", URL, BODY, components=("@method",)))
    assert "must cover" in reason(console_signed("POST", URL, BODY, components=("@method", "@path", "@query")))


def test_hand_signed_params_verify():
    assert verify(_resign(signed(), OK_PARAMS)).nonce == "n" * 22


@pytest.mark.parametrize(
    "params, expected",
    [
        (f';created={NOW};keyid="human:approver";nonce="{"n" * 22}"', 'alg="ed25519"'),
        (f';created={NOW};keyid="human:approver";alg="ed25519"', "nonce"),
        (f';keyid="human:approver";alg="ed25519";nonce="{"n" * 22}"', "created"),
        (OK_PARAMS + f";expires={NOW}", "expired"),
        (OK_PARAMS + ';other="x"', "other"),
        (f';created={NOW};keyid="human:approver";alg="hmac-sha256";nonce="{"n" * 22}"', ""),
    ],
)
def test_parameters_outside_the_profile_are_rejected(params, expected):
    assert expected in reason(_resign(signed(), params))


def test_a_future_expires_is_accepted():
    assert verify(_resign(signed(), OK_PARAMS + f";expires={NOW + 60}")).key_id == "human:approver"


@pytest.mark.parametrize(
    "components",
    ['("@method" "@authority" "@path" "content-digest")', '("@authority" "@path" "@query" "content-digest")'],
)
def test_a_signature_that_leaves_a_required_component_out_is_rejected(components):
    assert "must cover" in reason(_resign(signed(), OK_PARAMS, components=components))


def test_a_signature_without_the_digest_component_is_rejected_for_a_body():
    headers = _resign(signed(), OK_PARAMS, components='("@method" "@authority" "@path" "@query")')
    assert "Content-Digest" in reason(headers)


@pytest.mark.parametrize("drop", ["Signature", "Signature-Input"])
def test_both_signature_headers_are_needed(drop):
    headers = signed()
    del headers[drop]
    assert "needs both" in reason(headers)


def test_two_signatures_are_rejected():
    headers = signed()
    other = signed(nonce="m" * 22)
    headers["Signature-Input"] += ", " + other["Signature-Input"].replace("aip=", "b=")
    headers["Signature"] += ", " + other["Signature"].replace("aip=", "b=")
    assert "ultiple" in reason(headers) or "one signature" in reason(headers)


def test_signature_headers_at_the_size_bound_are_read_and_one_past_it_refused():
    headers = signed()
    pad = httpsig.MAX_SIGNATURE_HEADER_CHARS - len(headers["Signature-Input"])
    at_limit = {**headers, "Signature-Input": headers["Signature-Input"] + " " * pad}
    assert len(at_limit["Signature-Input"]) == httpsig.MAX_SIGNATURE_HEADER_CHARS
    assert "longer than" not in reason(at_limit, url=URL.replace("x=1", "x=3"))  # read and checked, not refused
    over = {**headers, "Signature-Input": headers["Signature-Input"] + " " * (pad + 1)}
    assert "longer than" in reason(over)


def test_malformed_signature_headers_are_rejected_not_raised():
    for value in ("aip=", "%%%", "aip=:not-base64:"):
        assert reason({**signed(), "Signature": value})


def test_is_signed():
    assert httpsig.is_signed(["Host", "Signature-Input"]) and not httpsig.is_signed(["authorization"])


def test_fresh_nonces_fit_the_profile_and_differ():
    nonces = {httpsig.new_nonce() for _ in range(50)}
    assert len(nonces) == 50 and all(httpsig.NONCE_RE.match(n) for n in nonces)


_SEGMENT = st.text(alphabet=st.sampled_from("abcXYZ019-._~"), min_size=1, max_size=12)


@given(
    path=st.lists(_SEGMENT, min_size=1, max_size=4),
    query=st.one_of(st.none(), _SEGMENT),
    body=st.binary(max_size=256),
    method=st.sampled_from(["GET", "POST"]),
)
def test_every_signed_request_verifies_and_any_changed_body_byte_does_not(path, query, body, method):
    url = "http://127.0.0.1:8081/" + "/".join(path) + (f"?q={query}" if query is not None else "")
    headers = signed(method, url, body)
    assert verify(headers, method, url, body).signature_base.startswith(f'"@method": {method}')
    if body:
        flipped = bytes([body[0] ^ 1]) + body[1:]
        with pytest.raises(SignatureRejected):
            verify(headers, method, url, flipped)


def test_reasons_never_carry_key_material():
    text = reason(signed(key=OTHER))
    assert not re.search(r"[A-Za-z0-9+/]{40,}", text)


def test_the_readme_test_vector():
    """docs/approvals.md "Signed requests" prints these exact headers and base (for other implementations)."""
    key = Ed25519PrivateKey.from_private_bytes(bytes(32))
    body = b'{"decision":"approved","reason":"checked","policy_hash":"9c1185a5c5e9fc54612808977ee8f548b2258d31"}'
    url = "https://aip.example.com/aip/v1/approvals/apr_7f3a/decision"
    headers = sign_request(
        "POST", url, body, key, "human:acme-approver", created=1790000000, nonce="2m2hXz3hL0mR1c5vQk7yTA"
    )
    assert headers == {
        "Content-Digest": "sha-256=:LSr+79XFOZxag+5SDeq+KwAjWen9m8Ux4HsV1qthgcY=:",
        "Signature-Input": 'aip=("@method" "@authority" "@path" "@query" "content-digest");created=1790000000;'
        'keyid="human:acme-approver";alg="ed25519";nonce="2m2hXz3hL0mR1c5vQk7yTA"',
        "Signature": "aip=:kvoeRuo8J2y+c6/kY+SVDkN8Nd/Mi6bxYv1ubNgoVWOhzNg8yLWufhf6Zbx3Yjf8X2YAdu5S/OvQ84EJdbTEAQ==:",
    }
    verified = verify_request(
        "POST", url, list(headers.items()), body, public_key=lambda _: key.public_key(), now_s=1790000000
    )
    approvals = (Path(__file__).resolve().parents[2] / "docs" / "approvals.md").read_text()
    assert verified.signature_base in approvals


_HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=300)


@given(
    signature_input=st.one_of(
        _HEADER_TEXT,
        st.sampled_from(
            [
                'aip=("@method" "@authority" "@path" "@query");created=1790000000;keyid="human:approver";alg="ed25519"',
                'aip=("@method");keyid="human:approver"',
                "aip=();created=1",
                'a=("content-digest";key="x")',
            ]
        ),
    ),
    signature=st.one_of(_HEADER_TEXT, st.just("aip=:" + "A" * 86 + "==:")),
    digest=st.one_of(st.none(), _HEADER_TEXT),
    body=st.binary(max_size=64),
)
def test_any_signature_headers_are_rejected_with_a_reason_never_another_error(signature_input, signature, digest, body):
    headers = {"Signature-Input": signature_input, "Signature": signature}
    if digest is not None:
        headers["Content-Digest"] = digest
    with pytest.raises(SignatureRejected) as caught:
        verify(headers, body=body)
    assert caught.value.reason


@given(tamper=st.sampled_from(["Signature-Input", "Signature", "Content-Digest"]), data=st.data())
def test_any_change_to_a_real_signature_header_is_rejected(tamper, data):
    headers = signed()
    value = headers[tamper]
    index = data.draw(st.integers(0, len(value) - 1))
    changed = value[:index] + data.draw(st.sampled_from('aZ9=:;"( ')) + value[index + 1 :]
    if changed != value:
        with pytest.raises(SignatureRejected):
            verify({**headers, tamper: changed})
