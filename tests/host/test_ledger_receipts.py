"""Signed result receipts: canonical document, signature, offline verification, rotation, key file
(host/ledger/receipts.py, docs/observing.md "Observing actions")."""

import base64
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from aip_crewai.contracts.hashing import jcs
from aip_crewai.host.ledger import receipts as rc
from aip_crewai.host.ledger.usage import SettingError
from aip_crewai.plumbing.keys import generate_ed25519

KEY = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
OLD = Ed25519PrivateKey.from_private_bytes(b"\x08" * 32)


def claims(key=KEY, **changes):
    base = dict.fromkeys(rc.CLAIMS)
    base.update(
        type=rc.RECEIPT_TYPE,
        id=rc.receipt_id("acme", "act_1"),
        key_id=rc.key_id(key.public_key()),
        tenant="acme",
        action_id="act_1",
        capability_id="cap:crewai:triage",
        crew_id="triage",
        operation="run",
        principal_id="svc:acme",
        input_hash="sha256:" + "a" * 64,
        status="completed",
        output_hash=rc.value_hash({"raw": "é"}),
        accepted_at="2026-09-21T10:00:00.000Z",
        finished_at="2026-09-21T10:00:01.500Z",
    )
    base.update(changes)
    return base


DOCUMENT, HASH = rc.sign(claims(), KEY)


def test_a_signed_receipt_verifies_and_returns_its_claims():
    assert rc.verify(DOCUMENT, [KEY.public_key()]) == claims()
    assert json.loads(DOCUMENT)["hash"] == HASH == rc.sha256_ref(jcs(claims()))


def test_the_document_is_its_own_canonical_form():
    assert jcs(json.loads(DOCUMENT)) == DOCUMENT


@settings(max_examples=300)
@given(st.data())
def test_any_one_byte_change_is_refused(data):
    position = data.draw(st.integers(0, len(DOCUMENT) - 1))
    byte = data.draw(st.integers(0, 255).filter(lambda b: b != DOCUMENT[position]))
    changed = DOCUMENT[:position] + bytes([byte]) + DOCUMENT[position + 1 :]
    with pytest.raises(rc.ReceiptInvalid):
        rc.verify(changed, [KEY.public_key()])


@pytest.mark.parametrize("extra", [b"\n", b" "])
def test_a_byte_added_at_the_end_is_refused(extra):
    with pytest.raises(rc.ReceiptInvalid, match="canonical"):
        rc.verify(DOCUMENT + extra, [KEY.public_key()])


def test_a_receipt_of_another_key_is_refused_and_names_the_key():
    with pytest.raises(rc.ReceiptInvalid, match=rc.key_id(KEY.public_key())):
        rc.verify(DOCUMENT, [OLD.public_key()])


def test_a_changed_claim_with_a_matching_hash_still_fails_the_signature():
    forged_claims = claims(status="failed")
    forged = json.loads(DOCUMENT)
    forged["receipt"], forged["hash"] = forged_claims, rc.sha256_ref(jcs(forged_claims))
    with pytest.raises(rc.ReceiptInvalid, match="signature does not verify"):
        rc.verify(jcs(forged), [KEY.public_key()])


def test_after_a_rotation_old_receipts_verify_with_the_previous_public_key():
    old_document, _ = rc.sign(claims(OLD), OLD)
    keys = rc.ReceiptKeys(KEY, (OLD.public_key(),))
    published = keys.published()["keys"]
    assert [(k["key_id"], k["current"]) for k in published] == [
        (rc.key_id(KEY.public_key()), True),
        (rc.key_id(OLD.public_key()), False),
    ]
    public = [rc.parse_public_key(k["public_key"]) for k in published]
    assert rc.verify(old_document, public)["key_id"] == rc.key_id(OLD.public_key())
    assert rc.verify(DOCUMENT, public)["key_id"] == keys.key_id


def test_sign_refuses_missing_unknown_or_foreign_claims():
    with pytest.raises(ValueError):
        rc.sign({**claims(), "extra": 1}, KEY)
    with pytest.raises(ValueError):
        rc.sign(claims(OLD), KEY)


def test_verify_bounds_the_document_size_at_its_edge():
    with pytest.raises(rc.ReceiptInvalid, match="larger than"):
        rc.verify(b" " * (rc.MAX_RECEIPT_BYTES + 1), [KEY.public_key()])
    with pytest.raises(rc.ReceiptInvalid, match="not JSON"):
        rc.verify(b" " * rc.MAX_RECEIPT_BYTES, [KEY.public_key()])


def test_receipt_ids_are_per_tenant_and_action():
    assert rc.receipt_id("acme", "a") != rc.receipt_id("globex", "a") != rc.receipt_id("acme", "b")
    assert rc.receipt_id("acme", "a").startswith("rcpt_") and len(rc.receipt_id("acme", "a")) == 37


def test_the_key_file_is_read_from_a_private_file(tmp_path):
    path = tmp_path / "receipt.key"
    public = generate_ed25519(path)
    keys = rc.load_keys(path, [base64.b64encode(rc.raw_public(OLD.public_key())).decode()])
    assert keys is not None and keys.published()["keys"][0]["public_key"] == public
    path.chmod(0o644)
    with pytest.raises(SettingError) as caught:
        rc.load_keys(path, [])
    assert caught.value.key == "host.receipt_key_file"


@pytest.mark.parametrize("text", ["not base64!", base64.b64encode(b"x" * 31).decode()])
def test_a_previous_public_key_must_be_32_bytes_of_base64(tmp_path, text):
    with pytest.raises(SettingError) as caught:
        rc.load_keys(None, [text])
    assert caught.value.key == "host.receipt_previous_public_keys[0]"


def test_no_key_file_means_no_receipts_and_previous_keys_need_one():
    assert rc.load_keys(None, []) is None
    with pytest.raises(SettingError):
        rc.load_keys(None, [base64.b64encode(rc.raw_public(OLD.public_key())).decode()])


def test_the_cli_verifies_offline_and_refuses_a_changed_byte(tmp_path, capsys):
    from aip_crewai.cli import main

    public = base64.b64encode(rc.raw_public(KEY.public_key())).decode()
    path = tmp_path / "receipt.json"
    path.write_bytes(DOCUMENT)
    assert main(["receipts", "verify", str(path), "--public-key", public, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["receipt"]["action_id"] == "act_1"
    changed = DOCUMENT.replace(b'"completed"', b'"completes"')
    path.write_bytes(changed)
    assert main(["receipts", "verify", str(path), "--public-key", public]) == 1
    assert "receipt refused: the hash is not the claims' hash" in capsys.readouterr().err
    assert main(["receipts", "verify", str(path), "--public-key", "nope"]) == 2
    assert main(["receipts", "verify", str(tmp_path / "missing"), "--public-key", public]) == 2


def test_keys_generate_receipt_prints_the_public_key_and_its_id(tmp_path, capsys):
    from aip_crewai.cli import main

    assert main(["keys", "generate", "receipt", "--out", str(tmp_path / "receipt.key")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["key_id"] == rc.key_id(rc.parse_public_key(printed["receipt_public_key"]))
    assert (tmp_path / "receipt.key").stat().st_mode & 0o777 == 0o600
